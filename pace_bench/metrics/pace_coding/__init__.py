"""The ``pace_coding`` metric folder: ``pace_coding.py`` (the ``evaluate`` module, which
``evaluate.load`` copies) and the sandbox that runs the answers' code (``sandbox.py``, with its
child side ``_sandbox_child.py``, started as a script)."""
