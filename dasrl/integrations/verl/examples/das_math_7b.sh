#!/usr/bin/env bash
# The paper's math setting in VeRL 0.9 with DAS: DeepSeek-R1-Distill-Qwen-7B, GRPO x16, 16K responses.
# Needs: pip install 'verl[vllm]==0.9.*' and dasrl in the same environment (every Ray worker imports it),
# DSR-sub converted to VeRL parquet under ~/data/dsr_sub/. Extra arguments override anything below.
set -euo pipefail
mapfile -t ARGS < <(python3 -m dasrl.integrations.verl.recipe --paper-math)
exec python3 -m verl.trainer.main_ppo "${ARGS[@]/\$HOME/$HOME}" "$@"
