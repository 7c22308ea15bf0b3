#!/usr/bin/env bash
# A/B of two revisions on a lent GPU, interleaved in ONE call: e2e runs of one revision vary
# by 1-3% between processes (clocks; the tuner's choice among near-tied kernel variants),
# so a change worth 1-2% only shows when both sides run alternately in the same call, each
# several times (BENCHMARKS.md, 2026-12-01 evening).
#
# On the CPU side, in the repository root (NVRTC 12 from pip builds the sm_70 PTX):
#
#   bash bench/ab_prepare.sh BASE_REV [NEW_REV]     # NEW_REV default: the working tree
#
# writes .ab/base and .ab/new (onecat, bench and their PTX; tests from NEW_REV when given)
# and .ab/run.sh; carry .ab and run there:
#
#   bash .ab/run.sh [MODELS] [BATCHES] [ROUNDS]    # default: 35b-a3b,27b 1,8,32 2
#
# It runs bench/e2e.py new, base, new, base, ... and prints each figure's runs and the ratio
# of the medians (new / base); the JSON of every run goes to $OUT.  Each side has its own
# cache directory (ONECAT_CACHE_DIR): the tuning table is keyed by the kernel sources only,
# so sides that differ outside the .cu files would otherwise share each other's choices.
#
# More candidates in the same call (device time is scarce): AB_PATCHES="a.diff b.diff" makes
# one more side per patch, the new side with that patch applied (named after the file,
# underscores as dashes), interleaved with the others and each compared with base; at most
# three fit the 64 MiB a call carries.  With AB_TESTS="tests/x.py ..." at run time, every
# side but base first runs those GPU tests.  With AB_BENCH="command" at run time, each side
# runs that command instead of e2e, in its tree with its PTX, SIDE / ROUND / OUT exported
# (e.g. AB_BENCH='python3 bench/kernels.py --m 32 --moe-tokens "" --out $OUT/k_${SIDE}_$ROUND.md'),
# which is how a timing-only probe patch (a kernel with a cost removed) is compared with base.
# More than 6 output files (a call brings back 8 at most) are packed into $OUT/ab_runs.tar.
set -eu
base_rev=${1:?usage: bench/ab_prepare.sh BASE_REV [NEW_REV]}
new_rev=${2:-}
python=${PYTHON:-python}
case "$python" in */*) python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")" ;; esac  # builds run in .ab/<side>
root=$(git rev-parse --show-toplevel)
cd "$root"
rm -rf .ab
mkdir -p .ab/base .ab/new
git archive "$base_rev" onecat bench | tar -x -C .ab/base
if [ -n "$new_rev" ]; then
  git archive "$new_rev" onecat bench tests | tar -x -C .ab/new
else
  git ls-files -co --exclude-standard onecat bench | tar -cf - -T - | tar -x -C .ab/new  # tests: the carried tree's
fi
sides="new"
for patch in ${AB_PATCHES:-}; do
  side=$(basename "$patch" .diff | tr '_' '-')
  mkdir -p ".ab/$side" && cp -r .ab/new/onecat .ab/new/bench ".ab/$side"  # tests: linked at run time
  git apply --directory=".ab/$side" "$patch" || { echo "ab_prepare: $patch does not apply to the new side" >&2; exit 1; }
  sides="$sides $side"
done
echo "$sides" > .ab/sides
for side in base $sides; do
  (cd ".ab/$side" && PYTHONPATH=$PWD "$python" -m onecat.cli build-kernels --arch sm_70 --out .ptx >/dev/null) &
done
wait
for side in base $sides; do
  ls ".ab/$side/.ptx/"*.ptx >/dev/null 2>&1 || { echo "ab_prepare: the $side side's PTX did not build (PYTHON=$python)" >&2; exit 1; }
done
rm -f .ab/*/.ptx/*.cubin  # the lent GPU runs the compute_70 PTX; carry stays under its 64 MiB (3 patches)
cp bench/ab_summary.py .ab/
cat > .ab/run.sh <<'RUN'
#!/usr/bin/env bash
# Written by bench/ab_prepare.sh: interleaved e2e runs of .ab/new and .ab/base.
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
models=${1:-35b-a3b,27b}
batches=${2:-1,8,32}
rounds=${3:-2}
export ONECAT_KERNEL_ARCH=70 PYTHONUNBUFFERED=1
sides=$(cat "$here/sides")
for side in ${AB_TESTS:+$sides}; do
  echo "== GPU tests, $side"
  tests="$here/new/tests"; [ -e "$tests" ] || tests="$here/../tests"
  [ -e "$here/$side/tests" ] || ln -s "$tests" "$here/$side/tests"
  (cd "$here/$side" && PYTHONPATH=$PWD ONECAT_KERNEL_DIR=$PWD/.ptx ONECAT_CACHE_DIR=$PWD/.cache timeout 300 python3 -m pytest -q -p no:cacheprovider \
    -m gpu $AB_TESTS 2>&1 | tail -n 2)
done
for round in $(seq 1 "$rounds"); do
  for side in $sides base; do
    echo "== $side, round $round"
    if [ -n "${AB_BENCH:-}" ]; then  # a kernel benchmark instead of e2e; SIDE, ROUND and OUT set
      (cd "$here/$side" && SIDE=$side ROUND=$round OUT=$out PYTHONPATH=$PWD ONECAT_KERNEL_DIR=$PWD/.ptx ONECAT_CACHE_DIR=$PWD/.cache \
        timeout 300 bash -c "$AB_BENCH" 2>&1 | tail -n 40)
      continue
    fi
    (cd "$here/$side/bench" && PYTHONPATH="$here/$side" ONECAT_KERNEL_DIR="$here/$side/.ptx" ONECAT_CACHE_DIR="$here/$side/.cache" \
      timeout 300 python3 e2e.py --models "$models" --batches "$batches" --skip-hf --prefill-repeats 1 \
      --out "$out/e2e_${side}_$round.json" 2>&1 | grep -E "^  [0-9].*(batch|prefill)|Error" )
  done
done
[ -n "${AB_BENCH:-}" ] || python3 "$here/ab_summary.py" "$out"
# A lent GPU call brings back at most 8 files from $OUT: more than 6 outputs (logs aside,
# which the caller may still be writing) go into one tar, unpacked here with tar -xf.
outputs=$(cd "$out" && ls -1 | grep -v -e '\.log$' -e '^ab_runs\.tar$' || true)
if [ "$(printf '%s\n' "$outputs" | grep -c .)" -gt 6 ]; then
  (cd "$out" && tar -cf ab_runs.tar $outputs && rm -f $outputs && echo "run.sh: outputs packed in ab_runs.tar")
fi
RUN
chmod +x .ab/run.sh
echo "prepared .ab (base $base_rev, new ${new_rev:-working tree}, sides: $sides); carry .ab and run: bash .ab/run.sh"
