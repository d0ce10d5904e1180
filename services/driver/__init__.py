"""The driver of one RL job: the restart loop and the order of a rollout step
(``loop.py``), and one module for each thing the loop orchestrates.

    loop.py         run_job: restarts, and one rollout step top to bottom
    job.py          the job's actors up and down (Ray, placement, manager, trainer group)
    pipeline.py     rollouts in flight ahead of training (rollout.async_steps), staleness
    advantages.py   what needs the trainer: the critic's values, the KL in the reward (β)
    critic_warmup.py  critic-only steps until its values are worth following
    weight_sync.py  trainer weights to the engines: start(version) / wait()
    evaluation.py   eval: config, when, pass@k, the final weights included
    checkpoint.py   the driver's part of a checkpoint, as data (JSON + safetensors)
    metrics.py      what a rollout step logs; progress lines
    sinks.py        where metrics go (metrics.jsonl, TensorBoard, W&B, the controller)
    run_dir.py      every file name of a job folder, once

Only ``run_dir``, ``sinks`` and ``evaluation``'s config import nothing heavy; the
controller uses them without torch or Ray.
"""
