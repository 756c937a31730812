"""Tools that pin an upstream SGLang release and apply this project's patch series to it."""
