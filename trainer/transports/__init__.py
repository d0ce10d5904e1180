"""The trainer ranks' halves of the weight transports, one file each.

    driver (services/driver/transports/<kind>.py)      every policy rank
    transport.send_weights(v) ── group.send_weights(step, sender, …) ──► PolicyRank.send_weights
                                                          └─ step(sender held here, rank, …)

A sender is a small picklable object naming its transport's settings (dtype, bucket
size, …). The group ships it with each call; a rank keeps the first equal one it gets
(``PolicyRank.send_weights``), so what a transport holds between calls (a joined
process group, a bucket shared with a server) lives on the rank, in its sender. A
sender reads the rank only through :class:`trainer.transports.base.BucketSource`.

    object_store.py  rank 0 puts each bucket in Ray's object store (CPU and GPU)
    nccl.py          rank 0 broadcasts each bucket to SGLang servers (GPU)
    cuda_ipc.py      rank 0 shares each bucket's CUDA IPC handles with a server (GPU)

The colocated path's sender (the engine in the rank's own process) is composed in
services (services/driver/transports/in_process.py): the trainer hosts no engine. The
bucket format is rollout/weight_bucket.py's, the one module both sides import.
"""
