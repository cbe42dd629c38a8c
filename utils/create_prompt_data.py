"""Write the prompt parquet files of a scenario: the agent's prompt per row plus a user profile per row.

Every row holds the agent's chat prompt (`prompt`: the scenario's system prompt and opening, as
`Scenario.render_agent_messages([])` renders them), the scenario name (`data_source`) and a `user_profile` (JSON
of `UserProfile.to_dict()`). During training the state controller samples the profiles (the column is used
only when the controller is off); validation and evaluation use the fixed, seeded profiles of the test file, so
their curves stay comparable across runs and iterations.

    python -m utils.create_prompt_data [--scenario verl/trainer/config/format_prompt/inbound_support.yaml] \\
        --train_samples 64 --test_samples 16 --out_dir outputs/prompt_data [--profiles generated.jsonl]

Profiles are drawn uniformly from the scenario's state space (extremes excluded unless --allow_extremes) with
1-3 behaviours from the library, or read from a JSONL file of profile objects or rows of
utils/generate_profiles.py (`--profiles`, first the train rows then the test rows; every line is validated and an
error names the file and line).
"""
from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from llm_agent.profiles.pool import profile_of_row
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, Scenario, UserProfile, load_scenario, sample_behaviors

logger = logging.getLogger(__name__)

TRAIN_FILE, TEST_FILE = "train.parquet", "test.parquet"


def valid_states(scenario: Scenario, allow_extremes: bool = False) -> list[tuple[int, ...]]:
    """The state combinations to draw from (values in the scenario's dimension order); extremes of each range
    excluded by default."""
    def inner(dim: str, value: int) -> bool:
        rng = scenario.state_ranges[dim]
        return allow_extremes or rng.min < value < rng.max
    return [s for s in scenario.state_space() if all(inner(d, v) for d, v in zip(scenario.dims, s))]


def random_profiles(scenario: Scenario, n: int, seed: int, allow_extremes: bool = False,
                    min_behaviors: int = 1, max_behaviors: int = 3) -> list[UserProfile]:
    """`n` seeded profiles: uniform initial states and `min_behaviors`..`max_behaviors` library behaviours."""
    rng = random.Random(seed)
    states = valid_states(scenario, allow_extremes)
    if not states:
        raise ValueError(f"scenario {scenario.name} has no state without an extreme value; use --allow_extremes")
    return [scenario.profile(rng.choice(states),
                             sample_behaviors(scenario.behaviors, rng, min_behaviors, max_behaviors))
            for _ in range(n)]


def read_profiles(path: str | Path, scenario: Scenario) -> list[UserProfile]:
    """Profiles from a JSONL file of `UserProfile.to_dict()` objects or profile-writer rows; ValueError names the
    file and line."""
    profiles = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                profile = profile_of_row(json.loads(line))
                scenario.check_profile(profile)
            except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{lineno}: bad profile: {exc}") from None
            profiles.append(profile)
    return profiles


def prompt_rows(scenario: Scenario, profiles: Iterable[UserProfile], split: str,
                system_prompt: str | None = None) -> list[dict]:
    """Parquet rows: agent prompt messages, scenario name, profile JSON and an index per row.

    `system_prompt` replaces the scenario's agent system prompt (e.g. a compact one for a tiny model)."""
    messages = scenario.render_agent_messages([])
    if system_prompt is not None:
        if not system_prompt.strip():
            raise ValueError("system_prompt must not be empty (None keeps the scenario's own)")
        messages[0] = {"role": "system", "content": system_prompt}
    return [{"prompt": messages, "data_source": scenario.name, "user_profile": json.dumps(p.to_dict()),
             "extra_info": {"split": split, "index": i}} for i, p in enumerate(profiles)]


def write_rows(rows: list[dict], path: Path) -> Path:
    """Write rows to a parquet file, creating its directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def create_prompt_data(scenario_path: str | Path, out_dir: str | Path, train_samples: int, test_samples: int,
                       seed: int = 0, allow_extremes: bool = False, profiles_file: str | Path | None = None,
                       system_prompt: str | None = None) -> dict[str, Path]:
    """Write `train.parquet` and `test.parquet` for a scenario under `out_dir`; return their paths by split.

    `system_prompt` replaces the scenario's agent system prompt in every row."""
    if train_samples < 0 or test_samples < 0 or train_samples + test_samples == 0:
        raise ValueError(f"need train_samples, test_samples >= 0 and not both 0, got {train_samples}, {test_samples}")
    scenario = load_scenario(scenario_path)
    if profiles_file is not None:
        profiles = read_profiles(profiles_file, scenario)
        if len(profiles) < train_samples + test_samples:
            raise ValueError(f"{profiles_file} has {len(profiles)} profiles, need {train_samples + test_samples}")
        train, test = profiles[:train_samples], profiles[train_samples:train_samples + test_samples]
    else:  # separate seeds: the test set does not change when the train size does
        train = random_profiles(scenario, train_samples, seed, allow_extremes)
        test = random_profiles(scenario, test_samples, seed + 1_000_003, allow_extremes)
    out = Path(out_dir)
    paths = {}
    for split, profiles, name in (("train", train, TRAIN_FILE), ("test", test, TEST_FILE)):
        if profiles:
            paths[split] = write_rows(prompt_rows(scenario, profiles, split, system_prompt), out / name)
            logger.info("wrote %d %s prompts of scenario %s to %s", len(profiles), split, scenario.name, paths[split])
    return paths


def main(argv: list[str] | None = None) -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default=str(DEFAULT_SCENARIO_PATH),
                        help="scenario YAML")
    parser.add_argument("--train_samples", type=int, required=True, help="number of training rows")
    parser.add_argument("--test_samples", type=int, required=True, help="number of validation rows")
    parser.add_argument("--out_dir", default="outputs/prompt_data", help="where train/test.parquet go")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random profiles")
    parser.add_argument("--allow_extremes", action="store_true", help="also draw the extreme state values")
    parser.add_argument("--profiles", default=None, help="JSONL of profiles to use instead of random ones")
    parser.add_argument("--system_prompt", default=None,
                        help="replace the scenario's agent system prompt (e.g. a compact one for a tiny model)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        paths = create_prompt_data(args.scenario, args.out_dir, args.train_samples, args.test_samples, args.seed,
                                   args.allow_extremes, args.profiles, args.system_prompt)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"create_prompt_data: {exc}") from None
    for path in paths.values():
        print(path)


if __name__ == "__main__":
    main()
