"""``python -m stack``: run the Procfile's processes together, as honcho does, and stop them in
their declared order (``make run`` uses it). Django-free: it only starts and signals processes.

``stack.procfile`` reads the Procfile, with its shutdown order and essential processes;
``stack.supervisor`` runs them.
"""
