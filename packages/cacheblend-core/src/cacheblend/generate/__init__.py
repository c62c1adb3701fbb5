"""After the fused prefill: the decode cache and step (:mod:`.decode`), next-token choice
and detokenization (:mod:`.sampling`), and the request's token loop (:mod:`.generation`)."""
