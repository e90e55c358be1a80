# One GPU call's frame, sourced by this folder's run scripts (from the repository root, carry [".whl", ...]):
# `. bench/results/gpu-2026-12-07/call.sh NAME OUT`. It makes the work folder w=/tmp/NAME (the card's name in
# card.txt), installs the carried wheels, and defines
#   step NAME LIMIT CMD...: CMD under `timeout LIMIT`, its output in $w/NAME.log, its exit code and seconds in
#                           $w/session.log
#   pack / finish:         archive $w as OUT/NAME.tgz; a packer does so every 15 s (a call cut by its limit
#                           still returns what finished); `finish` stops it and packs once more
name=$1; out=$2; mkdir -p "$out"; w=/tmp/$name; rm -rf $w; mkdir -p $w
pack() { tar czf "$out/$name.tgz" -C $w . 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > $w/card.txt 2>&1
(while sleep 15; do pack; done) & packer=$!
finish() { kill $packer; pack; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout $limit "$@" > $w/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" >> $w/session.log; }
