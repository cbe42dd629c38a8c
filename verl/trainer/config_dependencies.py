"""Config keys that need other keys, checked when the config loads: every error names the key to set.

- ``algorithm.filter_groups``: samples to compare (``rollout.n >= 2``), a metric, no KL-shaped metric before the KL;
- ``algorithm.rollout_correction``: parsable thresholds, options that take effect together, and the rollout
  engine's log-probs (``actor_rollout_ref.rollout.calculate_log_probs=true``);
- the batch entries an estimator or the diagnosis reweighting needs from a plug-in: ``turn_mixed`` the per-turn
  rewards ``turn_scores``, ``algorithm.diagnosis_reweight.enable`` the failure labels ``turn_labels``. The
  configured reward and rollout-loop plug-ins are asked what they write under their settings
  (:class:`verl.trainer.ppo.plugins.BatchOutputs`); they are imported only when such a key is on;
- settings that do nothing without another one (a warning each): diagnosis weights without ``enable``, an
  adaptive in-reward KL controller without ``use_kl_in_reward``, a critic warm-up without a critic.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from verl.trainer.config_schema import ConfigError, PPOTrainerConfig

logger = logging.getLogger(__name__)

__all__ = ["check_dependencies"]

TURN_LABELS = "turn_labels"  # verl.trainer.ppo.turn_layout.TURN_LABELS (not imported: it pulls in torch)


def _check_filter_groups(cfg: PPOTrainerConfig) -> None:
    filt = cfg.algorithm.filter_groups
    if filt.max_num_gen_batches < 0:
        raise ConfigError(f"algorithm.filter_groups.max_num_gen_batches must be >= 0 (0 = no limit), got "
                          f"{filt.max_num_gen_batches}")
    if not filt.enable:
        return
    if cfg.actor_rollout_ref.rollout.n < 2:
        raise ConfigError("algorithm.filter_groups.enable keeps prompt groups whose samples differ: set "
                          f"actor_rollout_ref.rollout.n >= 2 (got {cfg.actor_rollout_ref.rollout.n})")
    if not filt.metric:
        raise ConfigError("algorithm.filter_groups.metric must name a per-sample value, e.g. seq_reward")
    if filt.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise ConfigError("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: "
                          "groups are filtered before the KL penalty is computed; use seq_reward")


def _check_rollout_correction(cfg: PPOTrainerConfig) -> None:
    """``algorithm.rollout_correction``: parsable, finite thresholds; options that can take effect together."""
    from verl.trainer.ppo.rollout_corr_options import parse_rollout_is_threshold, rejection_options

    corr, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    try:
        parse_rollout_is_threshold(corr.rollout_is_threshold)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}.rollout_is_threshold={corr.rollout_is_threshold!r}: {exc}") from None
    if corr.rollout_rs is not None:
        try:
            rejection_options(corr.rollout_rs, corr.rollout_rs_threshold)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{key}.rollout_rs={corr.rollout_rs!r}, rollout_rs_threshold="
                              f"{corr.rollout_rs_threshold!r}: {exc}") from None
    elif corr.rollout_rs_threshold is not None:
        logger.warning("%s.rollout_rs_threshold is set but rollout_rs is null: nothing is rejected", key)
    if corr.loss_type == "reinforce" and not corr.bypass_mode:
        raise ConfigError(f"{key}.loss_type=reinforce is the loss of bypass mode: set {key}.bypass_mode=true or "
                          "loss_type=ppo_clip")
    if corr.rollout_is_batch_normalize and corr.rollout_is is None:
        logger.warning("%s.rollout_is_batch_normalize has no effect without rollout_is", key)
    if corr.bypass_mode and corr.loss_type == "ppo_clip" and corr.rollout_is is not None:
        logger.warning("%s: with bypass_mode and loss_type=ppo_clip the PPO ratio already is pi/pi_rollout; the "
                       "rollout_is weights are only logged, not applied", key)
    if corr.enabled and not cfg.actor_rollout_ref.rollout.calculate_log_probs:
        raise ConfigError(f"{key} (rollout_is, rollout_rs or bypass_mode) needs the rollout engine's log-probs: "
                          "set actor_rollout_ref.rollout.calculate_log_probs=true")


def _plugin_needs(cfg: PPOTrainerConfig) -> dict[str, tuple[str, str]]:
    """The batch entries only a plug-in can write that this config needs: entry -> (what it is, which key
    needs it)."""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    from verl.trainer.ppo.estimator_inputs import PLUGIN_INPUTS, plugin_inputs

    algo = cfg.algorithm
    needs: dict[str, tuple[str, str]] = {}
    for name in plugin_inputs(ADV_ESTIMATOR_REGISTRY[algo.adv_estimator]):
        needs[name] = (PLUGIN_INPUTS[name], f"algorithm.adv_estimator={algo.adv_estimator}")
    if algo.diagnosis_reweight.enable:
        needs[TURN_LABELS] = ("the failure labels of the agent turns", "algorithm.diagnosis_reweight.enable=true")
    return needs


def _check_plugin_inputs(cfg: PPOTrainerConfig) -> None:
    """Each entry the config needs from a plug-in is written by the reward or the rollout loop under their
    settings; an undeclared plug-in gets a warning (it is only known at the first step)."""
    needs = _plugin_needs(cfg)
    if not needs:
        return
    from verl.trainer.ppo.plugins import SingleTurnRollout, declared_outputs, import_dotted

    plugins: list[tuple[str, Any, Mapping[str, Any]]] = [("reward.path", cfg.reward.path, cfg.reward.kwargs)]
    if cfg.rollout_loop.path:
        plugins.append(("rollout_loop.path", cfg.rollout_loop.path, cfg.rollout_loop.config))
    declared = []
    for key, path, settings in plugins:
        try:
            plugin = import_dotted(path, key)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        try:
            declared.append((key, path, declared_outputs(plugin, settings)))
        except ValueError as exc:
            raise ConfigError(f"{key}={path}: {exc}") from None
    if not cfg.rollout_loop.path:
        declared.append(("rollout_loop.path", "null", declared_outputs(SingleTurnRollout, {})))
    for entry, (what, needed_by) in needs.items():
        if any(outputs is not None and entry in outputs.written for _, _, outputs in declared):
            continue
        how = [f"{key}={path} writes them when {outputs.enabled_by[entry]}" for key, path, outputs in declared
               if outputs is not None and entry in outputs.enabled_by]
        undeclared = [f"{key}={path}" for key, path, outputs in declared if outputs is None]
        message = f"{needed_by} needs {what} (batch entry {entry!r})"
        if how:
            raise ConfigError(f"{message}: {'; '.join(how)}")
        if undeclared:
            logger.warning("%s; %s does not declare what it writes (verl.trainer.ppo.plugins.BatchOutputs): the "
                           "first step fails if nothing writes it", message, " and ".join(undeclared))
            continue
        raise ConfigError(f"{message}, which neither " + " nor ".join(f"{key}={path}" for key, path, _ in declared)
                          + " writes: use a reward plug-in that does (e.g. reward.path=llm_agent.reward.compute_reward"
                            " in the dialogue config sead_trainer) or switch the option off")


def _warn_ineffective(cfg: PPOTrainerConfig) -> None:
    algo = cfg.algorithm
    if algo.diagnosis_reweight.weights and not algo.diagnosis_reweight.enable:
        logger.warning("algorithm.diagnosis_reweight.weights are set but algorithm.diagnosis_reweight.enable=false: "
                       "no advantage is reweighted")
    if algo.kl_ctrl.type == "adaptive" and not algo.use_kl_in_reward:
        logger.warning("algorithm.kl_ctrl.type=adaptive controls the in-reward KL penalty, which is off "
                       "(algorithm.use_kl_in_reward=false): it has no effect")
    if cfg.trainer.critic_warmup > 0 and not cfg.need_critic:
        logger.warning("trainer.critic_warmup=%d without a critic (algorithm.adv_estimator=%s): the first %d steps "
                       "do not update the actor", cfg.trainer.critic_warmup, algo.adv_estimator,
                       cfg.trainer.critic_warmup)


def check_dependencies(cfg: PPOTrainerConfig) -> None:
    """Every check above; ConfigError naming the key to set."""
    _check_filter_groups(cfg)
    _check_rollout_correction(cfg)
    _check_plugin_inputs(cfg)
    _warn_ineffective(cfg)
