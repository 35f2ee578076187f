"""The applications of the RL room, one module each (imported by their module path, so that
`mxrl train` checks its config before anything imports torch): `mxrl train` (`train`, its
checks in `preflight`), `mxrl demo` (`demo`, `demo_report`, `progress`), the SFT warm-up
(`warmup`), the embedded task, prompt datasets and reward functions (`task`, `data`, `rewards`,
`sources`) and the trainer-vs-rollout probe (`probe`); docs/rl.md."""
