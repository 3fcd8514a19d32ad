"""Lower a jitted function for CUDA on a machine without a GPU: the Pallas -> Triton lowering runs
in Python, so an op the Triton lowering does not support fails here, in CI, not first on the H200.
(Triton's own compile to PTX, and its register and shared-memory limits, still need the GPU.)"""
import jax

TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_cuda(fn, *args) -> str:
    """The StableHLO text of `jax.jit(fn)` lowered for CUDA at the shapes/dtypes of `args`."""
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*specs)
    return exported.mlir_module()
