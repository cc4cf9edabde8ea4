"""What each name in the config means, written once.

IS levels, filter levels and options, sequence aggregations, truncation types, filter statistics.
"""
