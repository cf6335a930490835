"""Ring attention over the ``(node, local)`` mesh: which chunk each rank holds at each step
(:mod:`.schedule`) and the exact dense / block-sparse ring with its ``custom_vjp`` backward
(:mod:`.attention`). The per-step kernels and the ``(out, lse)`` merge live below, in
``pallas_kernels`` (``api``, ``merge``), so the XLA twin and the Triton / Mosaic kernels share them."""
