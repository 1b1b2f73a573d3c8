#!/bin/bash
# plan2's tests (run under /work/bin/cpujob)
cd /work/wt/plan
export PYTHONPATH=/work/wt/plan
PY=/work/main/.venv/bin/python
L=/tmp/plan2/logs; mkdir -p $L
run() { name=$1; shift; echo "[$(date -u +%T)] start $name" >> $L/progress; timeout "$@" > $L/$name.log 2>&1; echo "[$(date -u +%T)] end $name rc=$?" >> $L/progress; }
run unit 600 $PY -m pytest -q -p no:cacheprovider tests/unit/test_planner.py tests/unit/test_validation.py tests/unit/test_targets.py tests/unit/test_comm_layout.py
run dist_planner 600 $PY -m pytest -q -p no:cacheprovider tests/distributed/test_planner.py
run dist_hooks 900 $PY -m pytest -q -p no:cacheprovider tests/distributed/test_compression_hooks.py tests/distributed/test_fusion_hierarchy.py
run e2e 1200 $PY -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/e2e/test_bench_plan_switch.py
