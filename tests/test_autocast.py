import asyncio
import contextvars
import threading

import pytest

from mxtrain.autocast import get_recipe, is_autocast_enabled, mx_autocast
from mxtrain.recipes import MXFP4Recipe, MXFP6Recipe, MXFP8Recipe, MXINT8Recipe, MXRecipe

FP4 = MXFP4Recipe()
INT8 = MXINT8Recipe()


def test_off_by_default():
    assert get_recipe() is None
    assert not is_autocast_enabled()


def test_enabled_without_recipe_uses_default_mxfp8():
    with mx_autocast() as active:
        assert get_recipe() == MXFP8Recipe()
        assert active is get_recipe()
        assert is_autocast_enabled()
    assert get_recipe() is None


def test_given_recipe_is_active_as_is():
    recipe = MXRecipe(fprop_input="int4")
    with mx_autocast(recipe=recipe) as active:
        assert get_recipe() is recipe and active is recipe


def test_disabled_block_ignores_its_recipe():
    with mx_autocast(enabled=False, recipe=FP4) as active:
        assert active is None
        assert get_recipe() is None and not is_autocast_enabled()


def test_nesting_inner_wins_and_outer_is_restored():
    with mx_autocast(recipe=FP4):
        with mx_autocast(recipe=INT8):
            assert get_recipe() is INT8
            with mx_autocast(enabled=False):
                assert get_recipe() is None and not is_autocast_enabled()
            assert get_recipe() is INT8
        assert get_recipe() is FP4
    assert get_recipe() is None


def test_restored_after_exception():
    with mx_autocast(recipe=FP4):
        with pytest.raises(RuntimeError, match="boom"):
            with mx_autocast(recipe=INT8):
                raise RuntimeError("boom")
        assert get_recipe() is FP4
        with pytest.raises(KeyError):
            with mx_autocast(enabled=False):
                raise KeyError("x")
        assert get_recipe() is FP4
    assert get_recipe() is None


def test_same_object_entered_twice():
    ctx = mx_autocast(recipe=FP4)
    with ctx:
        with mx_autocast(recipe=INT8):
            with ctx:
                assert get_recipe() is FP4
            assert get_recipe() is INT8
        assert get_recipe() is FP4
    assert get_recipe() is None


def test_exit_out_of_order_is_an_error():
    outer, inner = mx_autocast(recipe=FP4), mx_autocast(recipe=INT8)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="out of order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert get_recipe() is None


def test_decorator():
    @mx_autocast(recipe=FP4)
    def forward(x):
        """Docstring kept."""
        return x, get_recipe()

    assert forward(3) == (3, FP4)
    assert get_recipe() is None
    assert forward.__name__ == "forward" and forward.__doc__ == "Docstring kept."
    with mx_autocast(recipe=INT8):
        assert forward(1) == (1, FP4)
        assert get_recipe() is INT8


def test_decorator_default_recipe_and_disabled():
    @mx_autocast()
    def default():
        return get_recipe()

    @mx_autocast(enabled=False)
    def disabled():
        return get_recipe()

    assert default() == MXFP8Recipe()
    with mx_autocast(recipe=FP4):
        assert disabled() is None
        assert get_recipe() is FP4


def test_decorator_restores_after_exception_and_recursion():
    @mx_autocast(recipe=FP4)
    def depth(n):
        if n == 0:
            raise ValueError("bottom")
        assert get_recipe() is FP4
        return depth(n - 1)

    with pytest.raises(ValueError, match="bottom"):
        depth(5)
    assert get_recipe() is None


def _in_thread(target):
    result = {}

    def run():
        result["value"] = target()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result["value"]


def test_new_thread_does_not_inherit_autocast():
    with mx_autocast(recipe=FP4):
        assert _in_thread(get_recipe) is None
        assert _in_thread(is_autocast_enabled) is False
        assert get_recipe() is FP4


def test_thread_can_run_in_a_copy_of_the_callers_context():
    with mx_autocast(recipe=FP4):
        context = contextvars.copy_context()
    assert _in_thread(lambda: context.run(get_recipe)) is FP4


def test_threads_with_different_recipes_each_see_their_own():
    recipes = [FP4, INT8, MXFP6Recipe(), MXFP8Recipe(fp8_format="hybrid"), None]
    barrier = threading.Barrier(len(recipes))
    seen, errors = {}, []

    def worker(index, recipe):
        try:
            with mx_autocast(enabled=recipe is not None, recipe=recipe):
                barrier.wait(timeout=10)  # every thread is inside its block at once
                observed = [get_recipe() for _ in range(200)]
                barrier.wait(timeout=10)
                seen[index] = observed
            assert get_recipe() is None
        except Exception as err:  # surfaced by the main thread below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i, r)) for i, r in enumerate(recipes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for index, recipe in enumerate(recipes):
        assert all(r is recipe for r in seen[index])


def test_one_decorated_function_shared_by_threads():
    @mx_autocast(recipe=INT8)
    def observe():
        barrier.wait(timeout=10)
        return get_recipe()

    barrier = threading.Barrier(4)
    results = []
    threads = [threading.Thread(target=lambda: results.append(observe())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [INT8] * 4


def test_asyncio_tasks_are_isolated():
    async def task(recipe):
        with mx_autocast(recipe=recipe):
            await asyncio.sleep(0)  # let the other task run inside its own block
            return get_recipe()

    async def main():
        return await asyncio.gather(task(FP4), task(INT8))

    assert asyncio.run(main()) == [FP4, INT8]
    assert get_recipe() is None


@pytest.mark.parametrize("enabled", [1, 0, None, "true"])
def test_enabled_must_be_bool(enabled):
    with pytest.raises(TypeError, match=r"mx_autocast\(enabled=...\) must be a bool, got"):
        mx_autocast(enabled=enabled)


@pytest.mark.parametrize("recipe", ["mxfp8", MXFP8Recipe, {"recipe": "MXFP8Recipe"}, 8])
def test_recipe_must_be_a_recipe_instance(recipe):
    with pytest.raises(TypeError, match=r"mx_autocast\(recipe=...\) must be a recipe instance"):
        mx_autocast(recipe=recipe)


def test_string_recipe_error_points_to_the_parser():
    with pytest.raises(TypeError, match="recipe_from_string"):
        mx_autocast(recipe="mxfp8")
    with pytest.raises(TypeError, match="must be a recipe instance"):
        mx_autocast(enabled=False, recipe="mxfp8")  # checked even when disabled


def test_decorating_a_non_callable_is_an_error():
    with pytest.raises(TypeError, match="decorates a callable"):
        mx_autocast()(42)


def test_repr():
    assert repr(mx_autocast(recipe=FP4)) == "mx_autocast(enabled=True, recipe=MXFP4Recipe())"
    assert repr(mx_autocast(enabled=False, recipe=FP4)) == "mx_autocast(enabled=False, recipe=None)"
