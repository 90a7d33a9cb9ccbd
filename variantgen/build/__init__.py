"""Building and caching modules: the content-addressed cache, ninja, shared objects."""
