"""rljob workers: rollout engines, RL algorithms, buffer, transport and weight sync."""
