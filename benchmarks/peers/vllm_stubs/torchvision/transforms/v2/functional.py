def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise ImportError(f"torchvision is a stand-in in this venv (text models only): {name} is not available")

    return unavailable
