"""Ring attention over the ``(node, local)`` mesh: which chunk each rank holds at each step
(:mod:`.schedule`), the exact dense / block-sparse ring with its ``custom_vjp`` (:mod:`.attention`;
its options and static configuration :mod:`.config`, the index-source contract :mod:`.index_source`,
shared per-step helpers :mod:`.steps`, the K/V-side and query-side backward
rings :mod:`.backward`, chosen by bytes in :mod:`.sides`) and the sparse-aware K/V exchange
(:mod:`.exchange`, passes in :mod:`.exchange_ring`). The per-step kernels and the ``(out, lse)`` merge
live below, in ``pallas_kernels`` (``api``, ``merge``), so the XLA twin and the Triton / Mosaic
kernels share them."""
