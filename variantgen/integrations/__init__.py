"""Integrations of variantgen into other libraries' extension points (transformers)."""
