#!/usr/bin/env bash
# The checks only a GPU shows, prepared to run as they are on a lent GPU machine (docs/development.md, "On a GPU").
#
#   bash bench/gpu.sh batch trainer     # about 4 minutes on an H100: the benchmarks at GPU size
#   bash bench/gpu.sh tests             # about 5 minutes: the tests marked cuda
#
# batch:   GPT-2 small (12 layers, 768 wide, 512 tokens) written for a small card, micro-batches of 4 x 16
#          accumulation steps: samples/s and peak memory, original against the batch split (x4, x16), bf16 autocast,
#          and both, interleaved (bench/bench_batch.py).
# trainer: the Hugging Face Trainer fixture (a small GPT-2, micro-batches of 2 x 4): original against bf16, TF32,
#          fused AdamW and the batch split, interleaved.
# Output goes to stdout and, where the device tool sets OUT, to $OUT/gpu-<section>.log. libcst and optuna are not
# on the machine's image: carry them as wheels in .whl (the pip download command is in docs/development.md).
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ! python3 -c "import libcst, optuna" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
log() { if [ -n "${OUT:-}" ]; then tee "$OUT/gpu-$1.log"; else cat; fi; }
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'bench/gpu.sh needs a CUDA GPU')" || exit 2
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

[ $# -gt 0 ] || set -- batch trainer
for section in "$@"; do
    case "$section" in
    tests)
        python3 -m pytest -q -m cuda -p no:cacheprovider 2>&1 | log tests ;;
    batch)
        python3 bench/bench_batch.py --factors 4 16 --bf16 --repeat 2 --warmup 2 --steps 6 -- --device cuda \
            --n-layer 12 --n-embd 768 --n-head 12 --block-size 512 --vocab 50304 --batch-size 4 --accum 16 \
            --steps 10 2>&1 | log batch ;;
    trainer)
        python3 bench/bench_batch.py --script fixtures/transforms/hf_trainer/plain.in.py --factors --repeat 3 \
            --warmup 3 --steps 10 \
            --setting bf16=hf_trainer.precision=bf16 \
            --setting tuned=hf_trainer.precision=bf16,hf_trainer.tf32=true,hf_trainer.optim=adamw_torch_fused,hf_trainer.batch_split=4 \
            -- --steps 40 2>&1 | log trainer ;;
    *)
        echo "unknown section: $section (tests, batch, trainer)" >&2; exit 2 ;;
    esac
done
