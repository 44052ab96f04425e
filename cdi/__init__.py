"""CDI spec building (minimum cdiVersion) and crash-safe spec files."""
