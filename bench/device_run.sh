#!/usr/bin/env bash
# One call on a lent GPU machine: GPU tests and benchmarks on onecat's compute_70 PTX (the code
# a V100 runs, JIT-compiled by the newer GPU's driver). That machine has torch but no network,
# no vLLM and no CUDA 12 toolchain, so prepare on the CPU side, in the repository root:
#
#   python -m onecat.cli build-kernels --arch sm_70 --out .ptx        # NVRTC 12 (pip)
#   pip download --only-binary=:all: --no-deps --python-version 3.12 -d .whl \
#       fastapi starlette uvicorn pydantic pydantic-core annotated-types \
#       typing-inspection typing-extensions annotated-doc opentelemetry-api pyzmq msgspec
#
# carry .ptx and .whl (the server's wheels, for `serve`), then run there:
#
#   bash bench/device_run.sh tests profile e2e serve
#
# To compare two revisions, use bench/ab_prepare.sh instead (interleaved runs in one call).
#
# Issue 42 item 4 (long prompts) in three calls of at most 600 s (measured 2026-12-03: long-27b
# 270 s, long-35b 101 s, long-32gb 56 s; the serving parts did not fit one call):
#
#   bash bench/device_run.sh long-prompts                  # = long-27b long-35b: bench/e2e.py --long-only
#   bash bench/device_run.sh long-serve-35b long-serve-kv  # the long-document workload, 35B-A3B, 8-bit KV
#   bash bench/device_run.sh long-serve-27b long-32gb decode-long  # 27B; 128k in 31 GiB; decode NG sweep
#
# (`long` runs them all in one call, for a machine without that limit.) Every part writes its
# JSON after each row, so a part cut by its limit keeps what it measured. The KV dtypes other
# than fp16 run first and up to 32k tokens (their targets: capacity, decode at 32k).
#
# Sections run in the order given (default: tests e2e), each under its own time limit, so one
# slow part cannot eat the others' time; results (JSON and logs) go to $OUT or ./device-out.
set -u
out=${OUT:-$PWD/device-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/onecat-site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/onecat-site ONECAT_KERNEL_DIR=$PWD/.ptx ONECAT_KERNEL_ARCH=70 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run() {  # run SECONDS NAME COMMAND...: log to $out/NAME.log, print its tail
  local limit=$1 name=$2
  shift 2
  echo "== $name"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "(exit $?)"
  tail -n 25 "$out/$name.log"
}
sections=()
for section in ${@:-tests e2e}; do
  case $section in
    long) sections+=(long-27b long-35b long-serve-35b long-serve-kv long-serve-27b long-32gb decode-long) ;;
    long-prompts) sections+=(long-27b long-35b) ;;
    *) sections+=("$section") ;;
  esac
done
long_e2e="--long-only --long-prompts 2048,8192,32768,65536,131072 --prompt-attention onecat,sdpa-flash,sdpa-mem
  --kv-cache-dtype fp8_e5m2,int8,auto --kv-dtype-max-len 32768 --long-decode-steps 32"
for section in "${sections[@]}"; do
  case $section in
    tests) run 600 gpu-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/test_runtime_tp.py ;;
    tp-tests) NCCL_NVLS_ENABLE=0 TORCHDYNAMO_DISABLE=1 run 600 tp-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_runtime_tp.py ;;
    profile) (cd bench && run 300 profile python3 profile_step.py --model 27b --batches 1,8,32 --out "$out/profile_27b.json"
              run 200 profile-35b python3 profile_step.py --model 35b-a3b --batches 1,8,32 --prefill-len 0 \
                --out "$out/profile_35b.json") ;;
    mixed) (cd bench && for m in 35b-a3b 27b; do
               run 280 mixed-$m python3 profile_step.py --model $m --batches 32 --prefill-len 320 --steps 4 --top 25 \
                 --mixed 32:320,32:192,1:320 --out "$out/mixed_$m.json"; done) ;;
    tp) export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
        run 200 allreduce python3 bench/allreduce.py --world 2 --out "$out/allreduce.json"
        run 200 allreduce-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_all_reduce_gpu.py
        (cd bench && run 420 e2e-tp python3 e2e_tp.py --tp 1,2 --batches 1,8 --all-reduce custom,nccl --out "$out/e2e_tp.json") ;;
    moe-tiles) (cd bench && run 200 moe-tiles python3 kernels.py --moe-only --moe-tokens 40,64,128,320,512,1024,2048) ;;
    moe-shapes) (cd bench && run 150 moe-shapes python3 kernels.py --moe-shapes --moe-tokens 1,2,4,8,16,32 --json "$out/moe_shapes.json") ;;
    wmmar) (cd bench && run 300 wmmar python3 wmma_dequant.py --ms 8,16,32,64 --out "$out/wmmar.json") ;;
    quantize) run 560 quantize python3 bench/quantize.py --device cuda --samples 64 --seqlen 512 \
                --dense-layers 2 4 --method awq awq+gptq --json "$out/quantize.json" ;;
    serve32) (cd bench && run 500 serve32 python3 serve_h200.py --models 35b-a3b,27b --concurrency 32 --out "$out/serve32.json") ;;
    router) (cd bench && run 120 router python3 router.py --warps 8,4) ;;
    ncu) ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)  # stall reasons of the decode GEMMs and the MoE op
         (cd bench && ONECAT_AUTOTUNE=0 run 300 ncu "$ncu" --clock-control none --kernel-name regex:'w4a16_(wmmar|moe)' \
            --launch-skip 1 --launch-count 24 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
            --section Occupancy python3 ncu_targets.py) ;;
    gemv) (cd bench && run 150 gemv python3 gemv_sweep.py --out "$out/gemv_sweep.json") ;;
    norm) (cd bench && run 150 norm python3 norm.py --out "$out/norm.json") ;;
    gdn) (cd bench && run 120 gdn python3 gdn_decode.py --batches 1,4,8,9,16,32,64 --positions 1,4) ;;
    attention) (cd bench && run 120 attention python3 attention.py --out "$out/attention.json") ;;
    e2e) (cd bench && run 600 e2e python3 e2e.py --models 27b,35b-a3b --batches 1,8,32 --hf-layers 8 --out "$out/e2e.json") ;;
    serve) (cd bench && run 600 serve python3 serve_h200.py --models 35b-a3b,27b --concurrency 1,8,32,64 --out "$out/serve.json") ;;
    serve-dp2) (cd bench && run 300 serve-dp2 python3 serve_h200.py --models 35b-a3b --concurrency 64 \
                  --workloads 320:0.6:64 --data-parallel-size 2 --kill-replica-at 3 --out "$out/serve_dp2.json") ;;
    serve-decode) (cd bench && run 400 serve-decode python3 serve_h200.py --models 35b-a3b,27b --concurrency 32 \
                     --workloads 128:0:256 --out "$out/serve_decode.json") ;;
    long-27b) (cd bench && run 330 long-27b python3 e2e.py --models 27b $long_e2e --out "$out/long_27b.json") ;;
    long-35b) (cd bench && run 250 long-35b python3 e2e.py --models 35b-a3b $long_e2e --out "$out/long_35b.json") ;;
    long-32gb) (cd bench && run 100 long-32gb python3 e2e.py --models 27b --long-only --long-prompts 131072 \
                  --prompt-attention onecat --memory-cap-gib 31 --long-decode-steps 16 --out "$out/long_32gb.json") ;;
    long-serve-35b) (cd bench && run 260 long-serve-35b python3 serve_h200.py --models 35b-a3b --concurrency 8,32 \
                       --workloads longdoc --out "$out/long_serve_35b.json") ;;
    long-serve-27b) (cd bench && run 400 long-serve-27b python3 serve_h200.py --models 27b --concurrency 8,32 \
                       --workloads longdoc --out "$out/long_serve_27b.json") ;;
    long-serve-kv) (cd bench && run 330 long-serve-kv python3 serve_h200.py --models 35b-a3b --concurrency 32 \
                      --workloads longdoc --kv-cache-dtype int8,fp8_e5m2 --out "$out/long_serve_kv.json") ;;
    decode-long) (cd bench && run 90 decode-long python3 decode_long_context.py --out "$out/decode_long.json") ;;
    ttft) (cd bench && run 150 ttft python3 serve_h200.py --models 27b --concurrency "" --ttft-run --out "$out/ttft.json") ;;
    ipc-latency) run 60 ipc-latency python3 bench/ipc_latency.py --repeats 3 ;;  # the host CPU's share of TTFT
    *) echo "unknown section $section (tests, tp-tests, tp, profile, mixed, quantize, moe-tiles, moe-shapes, wmmar, serve32, router, ncu, gemv, norm, gdn, attention, e2e, serve, serve-dp2, serve-decode, long, long-prompts, long-27b, long-35b, long-32gb, long-serve-35b, long-serve-27b, long-serve-kv, decode-long, ttft, ipc-latency)" >&2; exit 2 ;;
  esac
done
