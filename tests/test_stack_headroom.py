"""``varjax.stack_headroom``: traces start from a frame big enough that CPython maps them a
fresh frame-stack chunk (the speed it buys is measured in ``bench/``, not here)."""
import pytest

from varjax import stack_headroom


def test_call_with_headroom_calls_through_and_lets_errors_out():
    assert stack_headroom.call_with_headroom(lambda *a: sum(a), 1, 2, 3) == 6
    with pytest.raises(KeyError, match="k"):
        stack_headroom.call_with_headroom({}.__getitem__, "k")


def test_the_calling_frame_is_bigger_than_a_frame_stack_chunk():
    """CPython 3.11 allocates frames in 16 KiB chunks; a frame of SLOTS 8-byte locals
    (about 32 KiB) cannot fit in what is left of one, so it starts a fresh, larger chunk."""
    code = stack_headroom.call_with_headroom.__code__
    assert code.co_nlocals >= stack_headroom.SLOTS
    assert stack_headroom.SLOTS * 8 > 16 * 1024
