"""kvpool's Prometheus series: the catalog (``catalog.py``) and its prometheus_client exporters
(``prom.py``)."""
