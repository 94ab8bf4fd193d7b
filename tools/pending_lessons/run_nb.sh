#!/bin/bash
# usage: run_nb.sh NAME...   execute in place (default threads), then nbval (one thread); nbval's own run
# rewrites figures/ and the records, so figures/ is put back as the in-place run left it
cd /work/main
for n in "$@"; do
  echo "=== $n exec $(date +%T)"
  start=$(date +%s)
  nice -n 19 .venv/bin/jupyter nbconvert --to notebook --execute --inplace notebooks/$n.ipynb > /tmp/w/exec_$n.log 2>&1 || { echo "EXEC FAILED $n"; tail -30 /tmp/w/exec_$n.log; continue; }
  echo "exec ok $n $(( $(date +%s) - start )) s"
  rm -rf /tmp/w/figsnap; cp -a figures /tmp/w/figsnap
  start=$(date +%s)
  OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python -m pytest -p no:cacheprovider --nbval notebooks/$n.ipynb -q > /tmp/w/nbval_$n.log 2>&1; rc=$?
  echo "nbval $n rc=$rc $(( $(date +%s) - start )) s: $(tail -1 /tmp/w/nbval_$n.log)"
  for f in figures/*; do cmp -s "$f" "/tmp/w/figsnap/$(basename $f)" || { echo "restoring $f"; cp -p "/tmp/w/figsnap/$(basename $f)" "$f"; }; done
done
