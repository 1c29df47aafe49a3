"""``vj.lift``: a body traced as a region in functionalized form, its variable traffic read
off the IR and re-emitted in the enclosing trace (``region.py``); what a body may touch
(``body.py``); variable groups handed to a transform (``groups.py``)."""
from varjax.lifting.region import lift as lift
