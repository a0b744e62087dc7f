"""Walking jaxprs in tests: every equation, nested ones included, and how a Pallas Mosaic GPU
kernel appears among them."""

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
