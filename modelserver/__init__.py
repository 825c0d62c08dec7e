"""The model server: what serves a model over SGLang's HTTP protocol (the local torch server and the
simulated one), the client every role talks to it with, the backend registry, and model loading and
preparation."""
