"""metadispatch inside the frameworks people train with.

``lightning`` gives ``FitCheck``, a ``lightning.Callback`` that traces one
steady-state training step of the LightningModule before ``fit`` and says
whether it fits on a logical GPU and how long it takes; ``lightning_step``
runs the Trainer's own loop for that batch and sets the Trainer up for it.  Each module imports
its framework, so none is imported by ``import metadispatch`` or by this
package: ``import metadispatch.integrations.lightning`` when you use it.
The top stage beside ``cli``: may import anything in the package.
"""
