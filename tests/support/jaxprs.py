"""Walking jaxprs in tests: every equation, nested ones included, and how a Pallas Mosaic GPU
kernel appears among them."""

from jax._src.interpreters import partial_eval as pe
from jax.extend import core

KERNEL_PRIMITIVE = "mpmd_map"  # how a Pallas Mosaic GPU kernel appears in a jaxpr


def equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it, a kernel's body excepted."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == KERNEL_PRIMITIVE:
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, core.ClosedJaxpr):
                    yield from equations(sub.jaxpr)
                elif isinstance(sub, core.Jaxpr):
                    yield from equations(sub)


def live(closed):
    """The jaxpr of a ClosedJaxpr without the equations no output needs (what XLA removes:
    e.g. a quantized copy nothing reads)."""
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    return jaxpr
