"""An independent float64 reference of credit assignment for the tests: every advantage estimator, the diagnosis
reweighting, and the rule that joins them to rollout rejection, as plain Python loops over rows, turns and tokens
(no torch maths). Written from the definitions: veRL's estimators (core_algos), docs/turn_level_credit.md, and the
rule of docs/turn_level_credit.md ("With rollout rejection"): credit is assigned to the dialogue as sampled, then the
rejected tokens leave the loss.

Inputs are nested lists of floats (rows x positions) or tensors (converted); ``mask`` is the sampled
``response_mask``, ``turn_ids`` the agent turn of every position (-1 off the agent turns).
"""
from __future__ import annotations

import math
import statistics
from typing import Optional

EPS = 1e-6


def rows_of(x) -> list[list[float]]:
    """Nested float lists of a tensor or a nested sequence."""
    return x.double().tolist() if hasattr(x, "double") else [[float(v) for v in row] for row in x]


def _turns(ids_row: list[int]) -> dict[int, list[int]]:
    """Turn id -> its positions, turns in increasing id order."""
    out: dict[int, list[int]] = {}
    for t, k in enumerate(ids_row):
        if k >= 0:
            out.setdefault(int(k), []).append(t)
    return dict(sorted(out.items()))


def whiten(values: list[list[float]], mask: list[list[float]]) -> list[list[float]]:
    """(v - mean) / sqrt(var + 1e-8) at every position, mean and unbiased variance over the mask's positions."""
    cells = [v for row, m in zip(values, mask) for v, k in zip(row, m) if k]
    mean = math.fsum(cells) / len(cells)
    var = math.fsum((c - mean) ** 2 for c in cells) / (len(cells) - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in values]


def _times_mask(values: list[list[float]], mask: list[list[float]]) -> list[list[float]]:
    return [[v if k else 0.0 for v, k in zip(row, m)] for row, m in zip(values, mask)]


def _groups(uid) -> dict[object, list[int]]:
    out: dict[object, list[int]] = {}
    for i, g in enumerate(uid):
        out.setdefault(g, []).append(i)
    return out


def _standardise(values: list[float], by_std: bool) -> list[float]:
    """GRPO's rule over one group: (v - mean) / (unbiased std + eps), mean-centred only without ``by_std``; a
    group of one uses mean 0 and std 1."""
    if len(values) == 1:
        mean, std = 0.0, 1.0
    else:
        mean, std = statistics.fmean(values), statistics.stdev(values)
    return [(v - mean) / (std + EPS) if by_std else v - mean for v in values]


def gae(rewards, values, mask, gamma: float, lam: float):
    """Token-level GAE skipping masked positions (rewards there ignored, running value and advantage carried
    through); returns = raw advantages + values; advantages whitened over the mask."""
    r, v, m = rows_of(rewards), rows_of(values), rows_of(mask)
    raw = []
    for ri, vi, mi in zip(r, v, m):
        out = [0.0] * len(ri)
        next_value = last = 0.0
        for t in reversed(range(len(ri))):
            if mi[t]:
                last = ri[t] + gamma * next_value - vi[t] + gamma * lam * last
                next_value = vi[t]
            out[t] = last
        raw.append(out)
    returns = [[a + b for a, b in zip(ra, vi)] for ra, vi in zip(raw, v)]
    return whiten(raw, m), returns


def grpo(rewards, mask, uid, by_std: bool = True):
    scores = [math.fsum(row) for row in rows_of(rewards)]
    adv = [0.0] * len(scores)
    for rows in _groups(uid).values():
        for i, a in zip(rows, _standardise([scores[i] for i in rows], by_std)):
            adv[i] = a
    m = rows_of(mask)
    out = [[adv[i] if k else 0.0 for k in m[i]] for i in range(len(m))]
    return out, out


def rloo(rewards, mask, uid):
    scores = [math.fsum(row) for row in rows_of(rewards)]
    adv = list(scores)
    for rows in _groups(uid).values():
        n = len(rows)
        if n > 1:
            for i in rows:
                others = [scores[j] for j in rows if j != i]
                adv[i] = scores[i] - math.fsum(others) / len(others)
    m = rows_of(mask)
    out = [[adv[i] if k else 0.0 for k in m[i]] for i in range(len(m))]
    return out, out


def reinforce_pp(rewards, mask, gamma: float):
    r, m = rows_of(rewards), rows_of(mask)
    returns = []
    for ri, mi in zip(r, m):
        out, running = [0.0] * len(ri), 0.0
        for t in reversed(range(len(ri))):
            if mi[t]:
                running = ri[t] + gamma * running
                out[t] = running
        returns.append(out)
    return _times_mask(whiten(returns, m), m), returns


def reinforce_pp_baseline(rewards, mask, uid):
    scores = [math.fsum(row) for row in rows_of(rewards)]
    centred = list(scores)
    for rows in _groups(uid).values():
        if len(rows) > 1:
            mean = math.fsum(scores[i] for i in rows) / len(rows)
            for i in rows:
                centred[i] = scores[i] - mean
    m = rows_of(mask)
    spread = [[centred[i] if k else 0.0 for k in m[i]] for i in range(len(m))]
    out = _times_mask(whiten(spread, m), m)
    return out, out


def remax(rewards, mask, baselines):
    r, m, b = rows_of(rewards), rows_of(mask), [float(x) for x in baselines]
    returns = [[math.fsum(ri[s] for s in range(t, len(ri)) if mi[s]) for t in range(len(ri))] for ri, mi in zip(r, m)]
    adv = [[ret[t] - (b[i] if m[i][t] else 0.0) for t in range(len(ret))] for i, ret in enumerate(returns)]
    return adv, returns


def turn_rewards(token_values, turn_ids) -> list[dict[int, float]]:
    """Per row: turn id -> the sum of ``token_values`` over the turn's tokens."""
    v, ids = rows_of(token_values), turn_ids.tolist() if hasattr(turn_ids, "tolist") else turn_ids
    return [{k: math.fsum(v[i][t] for t in ts) for k, ts in _turns(ids[i]).items()} for i in range(len(v))]


def turn_mixed(rewards, mask, turn_ids, turn_scores, uid, beta: float, by_std: bool = True):
    outcome, _ = grpo(rewards, mask, uid, by_std)
    per_turn = turn_rewards(turn_scores, turn_ids)
    ids = turn_ids.tolist() if hasattr(turn_ids, "tolist") else turn_ids
    out = [[0.0] * len(row) for row in outcome]
    for rows in _groups(uid).values():
        pooled = [(i, k, per_turn[i][k]) for i in rows for k in per_turn[i]]
        normalised = _standardise([x for _, _, x in pooled], by_std) if pooled else []
        for (i, k, _), a in zip(pooled, normalised):
            for t in _turns(ids[i])[k]:
                out[i][t] = outcome[i][t] + beta * a
    return out, out


def turn_gae(rewards, values, mask, turn_ids, turn_scores, gamma: float, lam: float):
    """GAE with one step per agent turn: reward = the turn's rewards (+ turn scores), value = values at its first
    token; every token of the turn gets its advantage (whitened over the mask) and return A + V, others 0."""
    ids = turn_ids.tolist() if hasattr(turn_ids, "tolist") else turn_ids
    v, m = rows_of(values), rows_of(mask)
    reward_rows = rows_of(rewards)
    if turn_scores is not None:
        reward_rows = [[a + b for a, b in zip(ra, rb)] for ra, rb in zip(reward_rows, rows_of(turn_scores))]
    per_turn = turn_rewards(reward_rows, ids)
    raw = [[0.0] * len(row) for row in v]
    returns = [[0.0] * len(row) for row in v]
    for i in range(len(v)):
        turns = _turns(ids[i])
        next_value = next_adv = 0.0
        for k in reversed(list(turns)):
            value = v[i][turns[k][0]]
            adv = per_turn[i][k] + gamma * next_value - value + gamma * lam * next_adv
            for t in turns[k]:
                raw[i][t], returns[i][t] = adv, adv + value
            next_value, next_adv = value, adv
    return _times_mask(whiten(raw, m), m), returns


def estimator(name: str, b: dict, uid, gamma: float, lam: float, by_std: bool, beta: float):
    """(advantages, returns) of estimator ``name`` on the sampled batch ``b`` (tensors by key)."""
    r, m = b["token_level_rewards"], b["response_mask"]
    if name == "gae":
        return gae(r, b["values"], m, gamma, lam)
    if name in ("grpo", "grpo_vectorized"):
        return grpo(r, m, uid, by_std)
    if name in ("rloo", "rloo_vectorized"):
        return rloo(r, m, uid)
    if name == "reinforce_plus_plus":
        return reinforce_pp(r, m, gamma)
    if name == "reinforce_plus_plus_baseline":
        return reinforce_pp_baseline(r, m, uid)
    if name == "remax":
        return remax(r, m, b["reward_baselines"].tolist())
    if name == "turn_mixed":
        return turn_mixed(r, m, b["agent_turn_ids"], b["turn_scores"], uid, beta, by_std)
    if name == "turn_gae":
        return turn_gae(r, b["values"], m, b["agent_turn_ids"], b.get("turn_scores"), gamma, lam)
    raise ValueError(name)


def diagnosis(advantages: list[list[float]], turn_ids, labels, weights: dict[str, float], apply_to: str):
    """Each token of a labelled turn scaled by the mean weight of its turn's distinct weighted labels (only where
    its advantage is negative / positive with ``apply_to``)."""
    ids = turn_ids.tolist() if hasattr(turn_ids, "tolist") else turn_ids
    out = [list(row) for row in advantages]
    for i, entry in enumerate(labels):
        if entry is None:
            continue
        for k, positions in _turns(ids[i]).items():
            weighted = sorted({label for label in entry[k] if label in weights})
            if not weighted:
                continue
            w = math.fsum(weights[label] for label in weighted) / len(weighted)
            for t in positions:
                a = out[i][t]
                if apply_to == "all" or (apply_to == "negative" and a < 0) or (apply_to == "positive" and a > 0):
                    out[i][t] = a * w
    return out


def credit_then_reject(advantages: list[list[float]], turn_ids, kept: list[list[float]]):
    """The rule's second half: (advantages, response_mask, agent_turn_ids) after rejection: the kept tokens keep
    their advantage and turn number, the rejected ones get 0 and -1."""
    ids = turn_ids.tolist() if hasattr(turn_ids, "tolist") else turn_ids
    adv = [[a if k else 0.0 for a, k in zip(row, mk)] for row, mk in zip(advantages, kept)]
    new_ids = [[int(t) if k else -1 for t, k in zip(row, mk)] for row, mk in zip(ids, kept)]
    return adv, [list(row) for row in kept], new_ids


def token_mean_pg_loss(advantages, kept, is_weights: Optional[list[list[float]]] = None,
                       denominator: Optional[float] = None) -> float:
    """The PPO policy loss at ratio 1 (old log-probs = the policy's): -A * w summed over the kept tokens, over
    ``denominator`` (default the number of kept tokens: token-mean)."""
    total, count = [], 0
    for i, row in enumerate(kept):
        for t, k in enumerate(row):
            if k:
                w = 1.0 if is_weights is None else is_weights[i][t]
                total.append(-advantages[i][t] * w)
                count += 1
    return math.fsum(total) / (count if denominator is None else denominator)
