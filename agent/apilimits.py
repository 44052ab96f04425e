"""The API server's limits on what the agent reads and writes, one definition each.

Read from k8s.io/api v0.37.2 (``resource/v1/types.go``), k8s.io/kubernetes v1.37
(``pkg/apis/resource/validation``) and k8s.io/apimachinery v0.37.2 (``pkg/api/resource``):
a claim, a slice or a status within these is one the server accepts or wrote itself, so
holding the same bounds refuses only what no API server hands out, and bounds the work done
on input from the claim files, the config file and the checkpoint as well.
"""

from __future__ import annotations

# defined where discovery holds its attributes to them (discovery imports nothing of agent/):
# a device's attributes and capacities together, its attribute values (each list element
# counted; ResourceSliceMaxAttributeValuesPerDevice), and the bytes of a string/version value
from discovery.attributes import MAX_ATTRIBUTE_VALUES, MAX_ATTRIBUTES_AND_CAPACITIES, MAX_VALUE_LENGTH  # noqa: F401

# --- resource.Quantity (apimachinery pkg/api/resource) ---------------------------------------
# ParseQuantity caps a binary quantity at the largest int64 (maxAllowed), the range of
# Quantity.Value(); a decimal one is held to it here too: no device capacity comes near it.
QUANTITY_MAX = 2**63 - 1
# ParseQuantity rounds every non-zero value up to a multiple of 1n (inf.RoundUp at scale 9)
QUANTITY_DECIMALS = 9
# ours: the canonical strings the server writes have at most 19 digits, a point and a suffix
QUANTITY_MAX_CHARS = 64

# --- ResourceClaim status.allocation.devices ---------------------------------------------------
MAX_RESULTS = 32  # AllocationResultsMaxSize (results maxItems)
MAX_ALLOCATION_CONFIGS = 64  # config maxItems: DeviceConfigMaxSize of the class plus of the claim
MAX_OPAQUE_PARAMETERS_BYTES = 10 * 1024  # OpaqueParametersMaxLength, of the parameters' JSON

# --- ResourceClaim status.devices (KEP-4817) ---------------------------------------------------
MAX_CONDITIONS = 8  # AllocatedDeviceStatusMaxConditions
MAX_DATA_BYTES = 10 * 1024  # AllocatedDeviceStatusDataMaxLength
MAX_IPS = 16  # NetworkDeviceDataMaxIPs
MAX_INTERFACE_NAME = 256  # bytes, NetworkDeviceDataInterfaceNameMaxLength
MAX_HARDWARE_ADDRESS = 128  # bytes, NetworkDeviceDataHardwareAddressMaxLength
MAX_REASON = 1024  # metav1 validation maxReasonLen
MAX_MESSAGE = 32 * 1024  # metav1 validation maxMessageLen
MAX_CLAIM_BYTES = 3 * 1024 * 1024  # etcd's request limit bounds every real ResourceClaim
MAX_DRIVER = 63  # DriverNameMaxLength
MAX_POOL = 253  # PoolNameMaxLength

# --- ResourceSlice -----------------------------------------------------------------------------
# (MAX_ATTRIBUTES_AND_CAPACITIES: ResourceSliceMaxAttributesAndCapacitiesPerDevice; a share's
# consumedCapacity lists at most the device's capacities)
MAX_ID_LENGTH = 32  # DeviceMaxIDLength
MAX_DOMAIN_LENGTH = 63  # DeviceMaxDomainLength
MAX_COUNTER_CONSUMPTIONS = 2  # ResourceSliceMaxDeviceCounterConsumptionsPerDevice
MAX_COUNTERS = 32  # ResourceSliceMaxCountersPerCounterSet
MAX_VALID_VALUES = 10  # CapacityRequestPolicyDiscreteMaxOptions
MAX_DEVICES = 128  # ResourceSliceMaxDevices
MAX_DEVICES_ADVANCED = 64  # any taint, consumesCounters or list attribute in the slice
MAX_COUNTER_SETS = 8  # ResourceSliceMaxCounterSets
