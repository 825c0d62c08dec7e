"""The inference role (``actor.py``): it drives a model server (``modelserver/``) through its client.

Nothing is imported eagerly here: importing the role's package must not pay for importing torch.
"""
