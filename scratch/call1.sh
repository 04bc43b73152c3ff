export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 200 python -m pytest -q tests/test_spec_loop.py tests/test_speculative.py tests/test_triton_kernels.py tests/test_attention.py tests/test_controller.py tests/test_parity.py > $OUT/tests.log 2>&1; echo TESTS_RC=$?; tail -4 $OUT/tests.log
timeout 330 python benchmarks/sweep.py --device cuda --requests 30 --max-tokens 100 --levels 1,2,5,10,30,70,100,250 --configs plain,chain,adaptive --rounds 3 --out $OUT/sweep_tiny.json > $OUT/sweep_tiny.log 2>&1; echo SWEEP_RC=$?; grep -a "C=" $OUT/sweep_tiny.log | tail -12
