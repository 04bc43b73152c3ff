export PYTHONPATH=$PWD
timeout 570 python benchmarks/synthetic_sweep.py --configs plain,chain,tree,adaptive-tree --profiles strong,shipped,weak --levels 1,2,5,10,30,70,100,250 --requests 16,16,20,40,60,140,200,500 --max-tokens 100 --prompt-len-min 128 --prompt-len-max 512 --warmup 3 --out $OUT/s.json > $OUT/sweep.log 2>&1; echo RC=$?; grep -a "C=" $OUT/sweep.log | tail -100
