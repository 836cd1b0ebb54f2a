"""The live dashboard: a sliding window over the server's metrics and the page that shows it."""

from pagoda.serve.dashboard.routes import install_dashboard, visible_tenants
from pagoda.serve.dashboard.window import DashboardWindow, Histogram, read_registry

__all__ = ["DashboardWindow", "Histogram", "install_dashboard", "read_registry", "visible_tenants"]
