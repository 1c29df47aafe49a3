"""The IR core: variable primitives and effects, the walker over nested jaxprs, dead-code
elimination, the error family, and the small value types everything above shares.  Imports
JAX (through ``varjax._jax``) and nothing else of varjax."""
