#!/usr/bin/env bash
# VCPO in verl 0.9.1 (docs/integrations.md, "verl"): Qwen2.5-7B-Instruct on GSM8K on one node of 8 GPUs,
# asynchronous (trainer.v1.trainer_mode=separate_async): 4 GPUs train (FSDP2), 4 GPUs of vLLM sample, at most
# 8 policy versions between a sample's rollout and its update.
#
# NOT RUN: written on a machine without a GPU. What was checked: every override below composes in verl's own
# ppo_trainer.yaml and gives the vcpo loss, VCPOAdamW and the separate-async settings verl asserts
# (tests/integrations/test_verl_example.py).
#
# Set-up on the node: verl 0.9.1 with its own vLLM/torch/transformers (verl's install docs), then this package
# with `pip install --no-build-isolation -e .`; the data with verl's examples/data_preprocess/gsm8k.py (it writes
# train.parquet and test.parquet; verl's built-in GSM8K reward scores them).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}

python -m verl.trainer.main_ppo \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.hybrid_engine=false \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.nnodes=1 \
    actor_rollout_ref.rollout.n_gpus_per_node=4 \
    actor_rollout_ref.rollout.checkpoint_engine.backend=nccl \
    trainer.v1.trainer_mode=separate_async \
    trainer.v1.separate_async.parameter_sync_step=4 \
    trainer.v1.sampler.max_off_policy_threshold=8 \
    trainer.nnodes=1 \
    trainer.n_gpus_per_node=4 \
    trainer.total_epochs=15 \
    trainer.project_name=vcpo \
    trainer.experiment_name=qwen2.5-7b-gsm8k-vcpo-k8 \
    algorithm.adv_estimator=grpo \
    algorithm.rollout_correction.bypass_mode=true \
    actor_rollout_ref.actor.policy_loss.loss_mode=vcpo \
    +actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=sequence \
    +actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold=8.0 \
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \
    actor_rollout_ref.actor.optim.optimizer_impl=vcpo.integrations.verl \
    actor_rollout_ref.actor.optim.optimizer=VCPOAdamW \
    'actor_rollout_ref.actor.optim.override_optimizer_config={lr_rule:linear,ess_base_ratio:1.0}' \
    "$@"
