"""The benchmarks' long-lived trainer rank 0 of the gloo checkpoint engine (the CPU stand-in for
HCCL, `npu_flashrl.sim.gloo_checkpoint_engine`):

    python benchmarks/_ce_trainer.py PORT WORLD BUCKET_BYTES THREADS

serves the group on 127.0.0.1:PORT, then reads one `verl_transfer.save_weights` file path per
line on stdin and sends it as one sync, printing `sent <seconds>` after each; an empty line or
the end of stdin ends it. One process for all syncs of a run, each started only when the
receiver asks for it: its start-up, its reading of the next file and its exit never overlap a
measured receive. THREADS torch threads, as the receiver's."""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    import torch
    from npu_flashrl.sim.gloo_checkpoint_engine import GlooCheckpointEngine, MasterMetadata, send_file

    port, world, bucket, threads = (int(a) for a in argv)
    torch.set_num_threads(threads)
    engine = GlooCheckpointEngine(bucket, is_master=True, timeout_s=600)
    engine.port = port
    engine.prepare()
    engine.init_process_group(0, world, MasterMetadata(engine.host, port))
    for line in sys.stdin:
        path = line.strip()
        if not path:
            break
        print(f"sent {send_file(engine, path):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
