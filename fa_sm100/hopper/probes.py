"""Cost probes of the SM90 backward: what does one piece of the kernel's work cost?

A config switch (``BwdConfig``) changes how the kernel does its work and keeps the results
right; ``scripts/ab_bench.py`` checks every variant's gradients before it times them. A probe
instead takes a piece of the work out, or replaces it with a cheaper one, so the time without
it can be measured: an upper bound on what any change to that piece could win. A probe's
results are wrong by design and nobody checks them.

Note [cost probes]: a probe is active inside ``with probe(name, value):``. The kernel code
reads it while it is traced (``active(name)``, a plain Python value: the probe picks code at
compile time, nothing at run time), and ``bwd_interface.launch_plan`` adds the active probes
to the main kernel's compile key (``compile_tag()``). So a probed kernel is compiled and
cached apart from the plain one: every call of the probed kernel must be made inside the
``with`` block (outside, the same arguments find the plain kernel), and a plain call never
gets a probed kernel. Probes:

- ``dq_reduce`` ("bulk" dQ only: the dq-store warp's bulk operations, bwd_store.py):
  ``none``: neither the bulk reduce nor the first store's copy is issued, so the float32 dQ
  accumulator is never written (the semaphores and barriers run as usual);
  ``half``: each reduce (and first-store copy) moves half of its part's bytes, half of the dQ
  traffic into L2;
  ``copy``: each reduce is a plain bulk copy of the same bytes: the writes without the
  additions at L2.
"""

import contextlib

PROBES = {
    "dq_reduce": {
        "none": "no dQ bulk reduce or first-store copy: the dQ accumulator is not written",
        "half": "each dQ bulk reduce and copy moves half its bytes",
        "copy": "each dQ bulk reduce is a plain bulk copy (the same bytes, no add in L2)",
    },
}

_active: dict = {}  # name -> value while a ``probe`` block is open


def check_probe(name: str, value: str) -> None:
    """Raise ValueError unless ``name=value`` is a probe of ``PROBES``."""
    if name not in PROBES:
        raise ValueError(f"unknown probe {name!r}: probes are {sorted(PROBES)}")
    if value not in PROBES[name]:
        raise ValueError(f"probe {name}={value!r}: values are {sorted(PROBES[name])}")


def parse_probe(spec: str):
    """``(name, value)`` from ``name=value`` (the ``--probe`` argument of ab_bench), checked."""
    name, sep, value = spec.partition("=")
    if not sep:
        raise ValueError(f"probe {spec!r}: expected name=value, e.g. dq_reduce=none")
    check_probe(name, value)
    return name, value


def check_probe_config(name: str, value: str, config) -> None:
    """Raise ValueError when probe ``name=value`` has nothing to probe in the backward built
    from ``config`` (a ``BwdConfig``): ``dq_reduce`` needs "bulk" dQ."""
    check_probe(name, value)
    if name == "dq_reduce" and config.dq_accum != "bulk":
        raise ValueError(f"probe dq_reduce={value} probes the bulk dQ reduce, but this "
                         f"config adds dQ with dq_accum={config.dq_accum!r} (the default at "
                         f"hdim {config.head_dim}): nothing to probe")


@contextlib.contextmanager
def probe(name: str, value: str):
    """Make ``name=value`` active in this block (Note [cost probes]); one value per name at a
    time, restored on exit."""
    check_probe(name, value)
    if name in _active:
        raise ValueError(f"probe {name} is already active ({name}={_active[name]})")
    _active[name] = value
    try:
        yield
    finally:
        del _active[name]


def active(name: str):
    """The active value of probe ``name`` (read while the kernel is traced), or None."""
    return _active.get(name)


def compile_tag() -> tuple:
    """The active probes as a hashable tag for compile keys; () when none is active."""
    return tuple(sorted(_active.items()))
