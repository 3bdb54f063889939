#!/usr/bin/env bash
# One prepared CUDA check (issue 14), at most 375 s on one GPU (every step has a timeout):
# exactness and peaks of remat on CUDA (pytest -m gpu), then the side-by-side comparison with
# eager, per-block checkpointing and torch.compile's memory budget on GPT-2- and Llama-style
# models, then HiRemate under FSDP2 sharded over one process (world size 1, NCCL: issue 33).
# Run from the repository root:
#     bash benchmarks/gpu_check.sh            # prints everything; exit status of the tests
set -uo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2
status=0
timeout 150 python -m pytest -q -m gpu tests/remat/test_cuda.py -p no:cacheprovider || status=$?
for model in hf-gpt2 hf-llama gpt; do
    timeout 45 python -m benchmarks.remat_compare --model "$model" --device cuda --layers 6 \
        --d-model 512 --heads 8 --seq 512 --vocab 8192 --batch 8 --budgets 100 50 \
        --time-limit 10 --steps 10 || echo "remat_compare --model $model: exit $?"
done
timeout 90 python -m benchmarks.remat_fsdp --device cuda --ranks 1 --quick \
    || echo "remat_fsdp --ranks 1: exit $?"
exit "$status"
