"""The case of a Hello's `pool_bytes` (P-12), kept in its own module so it registers after the
others (`omni_core.conformance` imports it) without touching the cases of other requirements."""

from __future__ import annotations

from omni_core.conformance.cases import Ctx, case


@case(
    "P-12",
    "hello_pool_bytes",
    "a Hello that gives pool_bytes names only its own tags, each with the bytes the first Sleep "
    "finds there (its pool_bytes_before); a Hello without them is accepted (skip)",
    scope="own",
)
def hello_pool_bytes(ctx: Ctx) -> None:
    (peer,) = ctx.own_harness().start([0], epoch=ctx.options.epoch)
    hello = peer.hello
    assert hello is not None
    if not hello.pool_bytes:
        ctx.skip("the Hello gives no pool_bytes (optional: the memory is known from the first report)")
    # Decoding refused a Hello naming tags it does not list; this says so again, in the report.
    ctx.check(set(hello.pool_bytes) <= set(hello.tags), "the Hello's pool_bytes name tags it does not list", got=hello)
    sleep, slept = ctx.sleep(1, peer)
    found = slept.memory.pool_bytes_before if slept.memory is not None else {}
    ctx.check(
        {tag: found.get(tag) for tag in hello.pool_bytes} == dict(hello.pool_bytes),
        "the Hello's pool_bytes are not what the first Sleep found in the pools",
        sent=sleep,
        got=slept,
        expected=f"pool_bytes_before {dict(hello.pool_bytes)} (the Hello's pool_bytes)",
    )
