// Command allocator runs the DRA structured-parameters allocator that kube-scheduler runs
// (k8s.io/dynamic-resource-allocation/structured) on one node's view of a cluster.
//
// It reads one JSON document on stdin:
//
//	{
//	  "node":            {...v1.Node...},          // or "nodeName": "n1" (labels: kubernetes.io/hostname)
//	  "resourceSlices":  [{...resource.k8s.io/v1 ResourceSlice...}],
//	  "deviceClasses":   [{...DeviceClass...}],
//	  "allocatedClaims": [{...ResourceClaim with status.allocation...}],  // devices already in use
//	  "claims":          [{...ResourceClaim...}],   // or "claim": {...}; allocated together, in order
//	  "features":        {"ListTypeAttributes": false}  // optional: switch allocator features off
//	}
//
// and writes one JSON document on stdout:
//
//	exit 0: {"allocator": "experimental", "features": [...], "results": [{"claim": "ns/name", "allocation": {...AllocationResult...}}]}
//	exit 2: {"unschedulable": true, "reason": "..."}   the claims do not fit on this node
//	exit 1: {"error": "..."}                            bad input or a fatal allocator error
//
// Claims and slices get the API server's defaulting first (the scheduler never sees
// undefaulted objects). Every allocator feature is on unless "features" turns it off: the point is to allocate
// against whatever the agent can publish.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"reflect"
	"sort"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	resourcedefaults "k8s.io/kubernetes/pkg/apis/resource/v1"
)

type input struct {
	Node            *v1.Node                     `json:"node"`
	NodeName        string                       `json:"nodeName"`
	ResourceSlices  []*resourceapi.ResourceSlice `json:"resourceSlices"`
	DeviceClasses   []*resourceapi.DeviceClass   `json:"deviceClasses"`
	AllocatedClaims []*resourceapi.ResourceClaim `json:"allocatedClaims"`
	Claims          []*resourceapi.ResourceClaim `json:"claims"`
	Claim           *resourceapi.ResourceClaim   `json:"claim"`
	Features        map[string]bool              `json:"features"`
}

type claimResult struct {
	Claim      string                       `json:"claim"`
	Allocation resourceapi.AllocationResult `json:"allocation"`
}

type output struct {
	Allocator     string        `json:"allocator,omitempty"`
	Features      []string      `json:"features,omitempty"`
	Results       []claimResult `json:"results,omitempty"`
	Unschedulable bool          `json:"unschedulable,omitempty"`
	Reason        string        `json:"reason,omitempty"`
	Error         string        `json:"error,omitempty"`
}

// classes is the DeviceClassLister the allocator looks classes up in.
type classes map[string]*resourceapi.DeviceClass

func (c classes) List() ([]*resourceapi.DeviceClass, error) {
	names := make([]string, 0, len(c))
	for name := range c {
		names = append(names, name)
	}
	sort.Strings(names)
	list := make([]*resourceapi.DeviceClass, 0, len(names))
	for _, name := range names {
		list = append(list, c[name])
	}
	return list, nil
}

func (c classes) Get(name string) (*resourceapi.DeviceClass, error) {
	if class, ok := c[name]; ok {
		return class, nil
	}
	return nil, apierrors.NewNotFound(schema.GroupResource{Group: "resource.k8s.io", Resource: "deviceclasses"}, name)
}

// features starts from everything on and applies the caller's overrides by field name.
func features(overrides map[string]bool) (structured.Features, error) {
	f := structured.Features{
		AdminAccess:             true,
		CompatibilityGroups:     true,
		ConsumableCapacity:      true,
		DerivedAttributes:       true,
		DeviceBindingAndStatus:  true,
		DeviceTaints:            true,
		FractionalCapacityRange: true,
		ListTypeAttributes:      true,
		OptionalNodeOperations:  true,
		PartitionableDevices:    true,
		PrioritizedList:         true,
	}
	value := reflect.ValueOf(&f).Elem()
	for name, on := range overrides {
		field := value.FieldByName(name)
		if !field.IsValid() || field.Kind() != reflect.Bool {
			return f, fmt.Errorf("unknown allocator feature %q", name)
		}
		field.SetBool(on)
	}
	return f, nil
}

// allocatedState is what the scheduler gathers from the claims that already hold devices:
// dedicated devices, shared (consumable-capacity) allocations and the capacity they consume.
func allocatedState(claims []*resourceapi.ResourceClaim, consumable bool) structured.AllocatedState {
	state := structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
	for _, claim := range claims {
		if claim == nil || claim.Status.Allocation == nil {
			continue
		}
		for _, result := range claim.Status.Allocation.Devices.Results {
			if result.AdminAccess != nil && *result.AdminAccess {
				continue // admin access does not take the device
			}
			id := structured.MakeDeviceID(result.Driver, result.Pool, result.Device)
			if consumable && result.ShareID != nil {
				state.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, result.ShareID))
				if result.ConsumedCapacity != nil {
					state.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(id, result.ConsumedCapacity))
				}
				continue
			}
			state.AllocatedDevices.Insert(id)
		}
	}
	return state
}

func claimKey(claim *resourceapi.ResourceClaim) string {
	if claim.Namespace == "" {
		return claim.Name
	}
	return claim.Namespace + "/" + claim.Name
}

func run(stdin io.Reader) (output, int) {
	decoder := json.NewDecoder(stdin)
	decoder.DisallowUnknownFields() // a field the v1.37 API does not know is an error, not silently dropped
	var in input
	if err := decoder.Decode(&in); err != nil {
		return output{Error: "decoding input: " + err.Error()}, 1
	}
	if in.Claim != nil {
		in.Claims = append(in.Claims, in.Claim)
	}
	if len(in.Claims) == 0 {
		return output{Error: "no claim to allocate (\"claim\" or \"claims\")"}, 1
	}
	node := in.Node
	if node == nil {
		if in.NodeName == "" {
			return output{Error: "no node (\"node\" or \"nodeName\")"}, 1
		}
		node = &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: in.NodeName, Labels: map[string]string{"kubernetes.io/hostname": in.NodeName}}}
	}
	feats, err := features(in.Features)
	if err != nil {
		return output{Error: err.Error()}, 1
	}
	lister := classes{}
	for _, class := range in.DeviceClasses {
		lister[class.Name] = class
	}
	// The scheduler only ever sees objects the API server has defaulted (allocationMode,
	// count, taint timeAdded, ...): apply the same defaulting code to the input.
	for _, slice := range in.ResourceSlices {
		resourcedefaults.SetObjectDefaults_ResourceSlice(slice)
	}
	for _, claim := range in.AllocatedClaims {
		resourcedefaults.SetObjectDefaults_ResourceClaim(claim)
	}
	for i, claim := range in.Claims {
		resourcedefaults.SetObjectDefaults_ResourceClaim(claim)
		if claim.UID == "" {
			claim.UID = types.UID(fmt.Sprintf("00000000-0000-0000-0000-%012d", i+1))
		}
	}

	ctx := klog.NewContext(context.Background(), klog.Background())
	celCache := cel.NewCache(10, cel.Features{
		EnableConsumableCapacity: feats.ConsumableCapacity,
		EnableListTypeAttributes: feats.ListTypeAttributes,
	})
	allocator, err := structured.NewAllocator(ctx, feats, allocatedState(in.AllocatedClaims, feats.ConsumableCapacity),
		lister, in.ResourceSlices, celCache)
	if err != nil {
		return output{Error: "creating allocator: " + err.Error()}, 1
	}
	out := output{Allocator: channel(allocator), Features: featureNames(feats)}
	results, err := allocator.Allocate(ctx, node, in.Claims)
	switch {
	case errors.Is(err, structured.ErrFailedAllocationOnNode):
		return output{Allocator: out.Allocator, Features: out.Features, Unschedulable: true, Reason: err.Error()}, 2
	case err != nil:
		return output{Allocator: out.Allocator, Features: out.Features, Error: err.Error()}, 1
	case results == nil:
		return output{Allocator: out.Allocator, Features: out.Features, Unschedulable: true,
			Reason: "cannot allocate all claims on node " + node.Name}, 2
	}
	for i, result := range results {
		out.Results = append(out.Results, claimResult{Claim: claimKey(in.Claims[i]), Allocation: result})
	}
	return out, 0
}

// channel names the allocator implementation NewAllocator picked (stable, incubating, experimental).
func channel(allocator structured.Allocator) string {
	method := reflect.ValueOf(allocator).MethodByName("Channel")
	if !method.IsValid() {
		return ""
	}
	return method.Call(nil)[0].String()
}

func featureNames(f structured.Features) []string {
	names := f.Set().UnsortedList()
	sort.Strings(names)
	return names
}

func main() {
	klog.InitFlags(nil) // -v=6 logs the allocator's progress on stderr
	flag.Parse()
	out, code := run(os.Stdin)
	encoder := json.NewEncoder(os.Stdout)
	encoder.SetIndent("", "  ")
	if err := encoder.Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, "allocator: writing output:", err)
		os.Exit(1)
	}
	os.Exit(code)
}
