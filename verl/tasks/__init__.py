"""Built-in tasks: small single-turn problems with a verifiable reward, used by the CPU demo and the tests.

- :mod:`verl.tasks.repeat_letter`: "repeat the letter x"; the reward is the fraction of the first tokens of the
  response that are the requested letter (with partial credit for any single letter). A randomly initialised
  tiny model learns it measurably within a few GRPO steps.
"""
