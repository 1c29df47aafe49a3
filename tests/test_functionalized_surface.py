"""``Functionalized``'s public methods are ``vj.functionalize``'s API; the hooks lifting and
object mode call are underscored."""
import inspect

from varjax.functionalization.functionalized import Functionalized


def test_functionalized_public_methods_are_the_api_and_not_the_lifting_hooks():
    public = {name for name, member in inspect.getmembers(Functionalized, inspect.isfunction)
              if not name.startswith("_")}
    assert public == {"init", "init_with_output", "apply", "jaxpr", "functional_jaxpr", "traced",
                      "run_pipeline"}
