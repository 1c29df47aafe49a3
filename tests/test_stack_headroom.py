"""``varjax.ir.stack_headroom``: traces start from a frame big enough that CPython maps them a
fresh frame-stack chunk (the speed it buys is measured in ``bench/``, not here)."""
import pytest

from varjax.ir import stack_headroom


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


def test_its_frame_is_not_a_user_frame_and_shows_no_source_line():
    """Source lines in errors and dumps name user code: the headroom frame, between the
    user's function and the trace, must not be taken for it."""
    import traceback

    from varjax import _jax

    assert not _jax.source_info_util.is_user_filename(stack_headroom.FILENAME)

    def fail():
        raise ValueError("inside")
    try:
        stack_headroom.call_with_headroom(fail)
    except ValueError as e:
        frames = traceback.extract_tb(e.__traceback__)
    (frame,) = [f for f in frames if f.name == "call_with_headroom"]
    assert frame.filename == stack_headroom.FILENAME and not frame.line
