"""Requests over more than one model, and answers from elsewhere than a model: ensembles,
cascades, Python compositions (BLS), the response cache and fallbacks. The executor here is
what the frontends call; below it, each model runs behind its own batcher."""
