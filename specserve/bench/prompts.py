"""The built-in prompt set: short coding and agentic tasks written for specserve's benchmarks.

Mostly Python, since the shipped default model is trained on Python source. Each entry is one user turn:
`specserve bench --endpoint chat` sends it as a message, `--endpoint completions` sends the text.
"""
from __future__ import annotations

# ---- write a function ----------------------------------------------------------------------------
WRITE = [
    "Write a Python function `is_palindrome(s: str) -> bool` that ignores case and punctuation.",
    "Write a Python function that merges two sorted lists into one sorted list in linear time.",
    "Implement `flatten(nested)` in Python: flatten arbitrarily nested lists of integers.",
    "Write a Python generator that yields the Fibonacci numbers below a given limit.",
    "Write a function that parses a query string like 'a=1&b=2&a=3' into a dict of lists.",
    "Implement an LRU cache class in Python with `get` and `put` in O(1) time.",
    "Write a Python function that returns the n most common words in a text file.",
    "Implement binary search over a sorted list; return the insertion point when the key is absent.",
    "Write a context manager `timer()` that prints how long its block took.",
    "Write a Python function that chunks an iterable into tuples of size n (the last may be shorter).",
    "Implement a thread-safe counter class in Python using `threading.Lock`.",
    "Write a function that converts a Roman numeral string to an integer.",
    "Write a Python decorator `retry(times, exceptions)` that retries a function on the given exceptions.",
    "Implement Dijkstra's shortest path on a dict-of-dicts graph in Python using `heapq`.",
    "Write a dataclass `Point` with a `distance_to(other)` method and a `__add__` operator.",
    "Write a function that reads a CSV file with `csv.DictReader` and sums one numeric column.",
]

# ---- fix a bug -------------------------------------------------------------------------------------
FIX = [
    "Fix the bug:\n```python\ndef average(xs):\n    return sum(xs) / len(xs) + 1\n```",
    "This function should reverse a list in place but does not. Fix it:\n```python\n"
    "def reverse(xs):\n    for i in range(len(xs)):\n        xs[i], xs[-i - 1] = xs[-i - 1], xs[i]\n```",
    "Why does this accumulate across calls? Fix it:\n```python\ndef add(item, items=[]):\n"
    "    items.append(item)\n    return items\n```",
    "Fix the off-by-one error:\n```python\ndef last_n(xs, n):\n    return xs[len(xs) - n - 1:]\n```",
    "This raises KeyError for new words. Fix it:\n```python\ncounts = {}\nfor w in words:\n"
    "    counts[w] += 1\n```",
    "Fix the infinite loop:\n```python\ni = 0\nwhile i < 10:\n    if i % 2:\n        continue\n"
    "    i += 1\n```",
    "The file is never closed when parsing fails. Fix it:\n```python\nf = open(path)\n"
    "data = json.load(f)\nf.close()\n```",
    "Fix this recursive factorial so it does not recurse forever:\n```python\ndef fact(n):\n"
    "    return n * fact(n - 1)\n```",
]

# ---- explain code -----------------------------------------------------------------------------------
EXPLAIN = [
    "Explain what this does:\n```python\nsorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[:3]\n```",
    "Explain the difference between `is` and `==` in Python with a short example.",
    "Explain what `functools.lru_cache` does and when it should not be used.",
    "Explain this snippet:\n```python\nfrom itertools import groupby\n"
    "runs = [(k, len(list(g))) for k, g in groupby(s)]\n```",
    "Explain how Python generators differ from lists, and when to prefer each.",
    "Explain what `__slots__` does in a Python class.",
    "Explain what `async def` and `await` do, with a two-coroutine example.",
]

# ---- write tests ------------------------------------------------------------------------------------
TESTS = [
    "Write pytest tests for a function `slugify(title)` that lowercases and joins words with '-'.",
    "Write unit tests for a `Stack` class with `push`, `pop` and `peek`; cover popping an empty stack.",
    "Write pytest tests for `parse_duration('1h30m') -> 5400`, including invalid input.",
    "Write a parametrized pytest test for a `gcd(a, b)` function.",
    "Write tests that check `json.loads(json.dumps(x)) == x` for a few nested values.",
]

# ---- refactor ---------------------------------------------------------------------------------------
REFACTOR = [
    "Refactor into a list comprehension:\n```python\nout = []\nfor x in xs:\n    if x > 0:\n"
    "        out.append(x * x)\n```",
    "Refactor this class to use `@dataclass`:\n```python\nclass User:\n"
    "    def __init__(self, name, age):\n        self.name = name\n        self.age = age\n```",
    "Refactor to remove the nested ifs:\n```python\ndef check(u):\n    if u:\n        if u.active:\n"
    "            if u.email:\n                return True\n    return False\n```",
    "Rewrite this with `pathlib` instead of `os.path`:\n```python\n"
    "p = os.path.join(os.path.dirname(f), 'data', 'x.txt')\n```",
    "Split this function into smaller ones:\n```python\ndef main():\n    data = open('in.txt').read()\n"
    "    rows = [r.split(',') for r in data.splitlines()]\n    total = sum(int(r[1]) for r in rows)\n"
    "    print(total)\n```",
]

# ---- agent-style tool use ---------------------------------------------------------------------------
AGENT = [
    "You can call `run_shell(cmd)`. List the Python files in the current folder that import `requests`.",
    "You have `read_file(path)` and `write_file(path, text)`. Add a docstring to every function in utils.py.",
    "Tools: `search(query)`, `open_url(url)`. Find the latest Python release and report its version.",
    "You can call `run_tests()` and `read_file(path)`. The test suite fails; find the failing test and "
    "propose a fix.",
    "Using `git_diff()` and `post_comment(text)`, review the current change and comment on one risk.",
    "You have `sql(query)`. Find the ten customers with the highest total order value.",
    "Plan the steps, then call `create_file(path, text)` to add a minimal `setup.cfg` for a package `demo`.",
    "With `http_get(url)` fetch https://example.com/data.json and summarize the keys of the object.",
]

BUILTIN_PROMPTS: list[str] = WRITE + FIX + EXPLAIN + TESTS + REFACTOR + AGENT
