"""One of two JAX processes (jax.distributed over localhost) on the GPU machine: lowers and runs a Mosaic GPU
forward, waits for ``pallas_kernels.mosaic_precompile``'s worker and reports what it did (``RESULT {json}``).
Started by ``tests/test_kernels_gpu.py::TestMosaicGPU::test_kernels_compile_early_in_two_processes`` as
``python tests/_precompile_mp_worker.py PORT PROCESS_ID``."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

port, pid = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid, initialization_timeout=120)

from pallas_kernels import mosaic_precompile as mp  # noqa: E402
from pallas_kernels.mosaic_fwd import mosaic_fwd  # noqa: E402
from pallas_kernels.testing import random_step_index  # noqa: E402

rng = np.random.default_rng(pid)
S, H, Hkv, D = 2048, 4, 2, 64
dev = jax.local_devices()[0]
q = jax.device_put(jnp.asarray(rng.standard_normal((1, S, H, D)), jnp.bfloat16), dev)
k = jax.device_put(jnp.asarray(rng.standard_normal((1, S, Hkv, D)), jnp.bfloat16), dev)
pos = jnp.arange(S, dtype=jnp.int32)
idx = random_step_index(rng, 1, H, S, S, pos, pos, max_blocks=8, max_cols=100)
out, lse = jax.jit(lambda q, k, idx: mosaic_fwd(q, k, k, pos, pos, idx, sm_scale=0.1 + 0.01 * pid))(q, k, idx)
done = mp.wait(120)
print("RESULT " + json.dumps({"pid": pid, "local": str(dev), "default": str(jax.devices()[0]), "waited": done,
                              "stats": mp.stats(), "finite": bool(jnp.isfinite(out).all()),
                              "absmax": float(jnp.abs(out).max())}), flush=True)
jax.distributed.shutdown()
