"""examples/verl/vcpo_gsm8k_async.sh against the real verl 0.9.1 config: every override composes in verl's
ppo_trainer.yaml (Hydra refuses a key that does not exist), the run gets the vcpo loss and VCPOAdamW, and the
separate-async settings pass the checks verl's PPOTrainerSeparateAsync makes before it starts Ray."""

import shlex
from pathlib import Path

import pytest
import torch

verl = pytest.importorskip("verl")  # installed with --no-deps (docs/integrations.md)
from hydra import compose, initialize_config_dir  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.config.optimizer import build_optimizer  # noqa: E402

from vcpo.integrations import verl as vv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "verl" / "vcpo_gsm8k_async.sh"


def script_overrides() -> list[str]:
    """The overrides the script passes to verl.trainer.main_ppo, with its shell variables set."""
    text = SCRIPT.read_text().split("python -m verl.trainer.main_ppo", 1)[1].split('"$@"', 1)[0]
    text = text.replace("$DATA", "/data/gsm8k").replace("$MODEL", "Qwen/Qwen2.5-7B-Instruct")
    return shlex.split(text.replace("\\\n", " "))


def doc_switch() -> list[str]:
    text = (ROOT / "docs" / "integrations.md").read_text().split("## verl", 1)[1]
    words = shlex.split(text.split("```bash\n", 1)[1].split("```", 1)[0])
    return [w for w in words if w.lstrip("+").startswith(("algorithm.", "actor_rollout_ref."))]


def test_the_example_composes_in_verls_config_with_the_documented_switch():
    overrides = script_overrides()
    assert set(doc_switch()) <= set(overrides)
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)

    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    options = vv.loss_options(actor, actor.loss_agg_mode)
    assert (options.is_level, options.is_correction, options.is_threshold) == ("sequence", "truncate", 8.0)
    assert actor.policy_loss.loss_mode == "vcpo" and cfg.algorithm.rollout_correction.bypass_mode
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim))
    assert type(opt) is vv.VCPOAdamW and opt.defaults["lr"] == 1e-6

    # what PPOTrainerSeparateAsync asserts in its constructor (verl 0.9.1), on the composed config
    assert cfg.trainer.v1.trainer_mode == "separate_async"
    assert cfg.data.train_batch_size == (cfg.trainer.v1.separate_async.parameter_sync_step
                                         * cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.nnodes > 0 and rollout.n_gpus_per_node > 0 and rollout.checkpoint_engine.backend != "naive"
    assert rollout.calculate_log_probs  # the behaviour log-probs the bypass mode needs
    # one node of 8 GPUs: 4 train, 4 sample
    assert cfg.trainer.n_gpus_per_node + rollout.n_gpus_per_node == 8 and cfg.trainer.v1.sampler.max_off_policy_threshold == 8


def test_a_trust_region_mode_composes_in_verls_config():
    """The example's switch with loss_mode=vcpo_gspo and verl's own GSPO bounds, no rollout_is (docs/integrations.md,
    "verl's own rules with VCPO's parts"): verl's config takes it, and the loss reads the bounds from verl's fields."""
    overrides = [o for o in script_overrides() if "rollout_correction.rollout_is" not in o and "loss_mode=" not in o]
    overrides += ["actor_rollout_ref.actor.policy_loss.loss_mode=vcpo_gspo",
                  "+actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=null",
                  "actor_rollout_ref.actor.clip_ratio_low=0.0003", "actor_rollout_ref.actor.clip_ratio_high=0.0004"]
    actor = omega_conf_to_dataclass(compose_actor(overrides))
    assert actor.policy_loss.loss_mode == "vcpo_gspo"
    options = vv.loss_options(actor, actor.loss_agg_mode, "gspo")
    assert (options.trust_rule, options.clip_ratio, options.is_correction) == ("gspo", (0.0003, 0.0004), "none")
    # without the rollout_is line verl's dataclass default (sequence-level IS) would reach the loss: refused
    default = omega_conf_to_dataclass(compose_actor(overrides[:-3] + overrides[-2:]))
    with pytest.raises(ValueError, match="rollout_is=null"):
        vv.loss_options(default, default.loss_agg_mode, "gspo")


def compose_actor(overrides: list[str]):
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides).actor_rollout_ref.actor
