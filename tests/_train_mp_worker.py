"""One process of the multi-process training test (tests/test_train_multiprocess.py).

Usage: python tests/_train_mp_worker.py PORT PROCESS_ID NUM_PROCESSES LOCAL_DEVICES RUN_DIR [key=value ...]
(started by ``tests/_multiprocess.run_workers``). Runs ``mtraining-train`` with a localhost
coordinator through the CLI's own ``--coordinator-address`` path; each process owns LOCAL_DEVICES
virtual CPU devices, the mesh is NUM_PROCESSES (node = process) x LOCAL_DEVICES (local).
"""

import os
import sys

# Before JAX is imported: CPU only, and forget the parent's device-count flag (keep its other flags,
# e.g. the test run's compile flags, so that this process compiles as the reference run does).
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                   if "xla_force_host_platform_device_count" not in f)

from mtraining_jax.apps.train import main  # noqa: E402  (the mtraining-train command)

if __name__ == "__main__":
    port, pid, nproc, ndev, run_dir, *overrides = sys.argv[1:]
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "tiny_cpu.yaml")
    sys.exit(main([
        "--config", config, *overrides, f"run_dir={run_dir}", f"mesh.cpu_devices={int(nproc) * int(ndev)}", f"mesh.shape=[{nproc},{ndev}]",
        "--coordinator-address", f"localhost:{port}", "--num-processes", nproc, "--process-id", pid,
    ]))
