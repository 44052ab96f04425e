// Command draplugin is the floor of the real-node bench (bench/bench_realnode.py, issue 43): the
// least a DRA kubelet plugin does, on the upstream helper every Go driver uses
// (k8s.io/dynamic-resource-allocation/kubeletplugin v0.37.2). The helper registers with the
// kubelet, serves the DRA gRPC API, GETs each claim the kubelet names and checks its allocation,
// serializes the calls, publishes the ResourceSlice and writes the KEP-5304 metadata; this file
// adds only what a driver must: one device, and per claim a CDI spec with the edits the device
// file gives (the bench copies them from what sysdra wrote for one GPU of the same node), written
// as crash-safely as the helper writes its metadata (temp file, fsync, rename, fsync of the dir).
//
// It keeps no checkpoint: the spec's file name is the claim's UID, which is all unprepare needs.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	metadatav1beta1 "k8s.io/dynamic-resource-allocation/api/metadata/v1beta1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
)

// deviceFile is the one device this plugin offers: its name and attributes in the slice, and the
// CDI edits a container gets for it (deviceEdits) and once per claim (claimEdits, to which the
// claim's SYSDRA_CLAIM_UID is added first).
type deviceFile struct {
	Name        string                                                    `json:"name"`
	Attributes  map[resourceapi.QualifiedName]resourceapi.DeviceAttribute `json:"attributes"`
	DeviceEdits map[string]any                                            `json:"deviceEdits"`
	ClaimEdits  map[string]any                                            `json:"claimEdits"`
}

type plugin struct {
	driver, node, cdiDir string
	device               deviceFile
	metadata             map[string]resourceapi.DeviceAttribute // the device's attributes, for its KEP-5304 metadata
	cancel               context.CancelCauseFunc
}

func main() {
	klog.InitFlags(nil)
	driver := flag.String("driver-name", "floor.sysdra.test", "the DRA driver name")
	node := flag.String("node-name", os.Getenv("NODE_NAME"), "the Node (and the pool) this plugin serves")
	kubeconfig := flag.String("kubeconfig", os.Getenv("KUBECONFIG"), "the API server's kubeconfig")
	kubeletDir := flag.String("kubelet-dir", "/var/lib/kubelet", "the kubelet's directory (plugins_registry, plugins)")
	cdiDir := flag.String("cdi-dir", "/var/run/cdi", "where the container runtime reads CDI specs")
	deviceJSON := flag.String("device", "", "the device file (JSON: name, attributes, deviceEdits, claimEdits)")
	flag.Parse()
	if err := run(*driver, *node, *kubeconfig, *kubeletDir, *cdiDir, *deviceJSON); err != nil {
		klog.ErrorS(err, "draplugin failed")
		os.Exit(1)
	}
}

func run(driver, node, kubeconfig, kubeletDir, cdiDir, deviceJSON string) error {
	p := &plugin{driver: driver, node: node, cdiDir: cdiDir}
	if err := p.load(deviceJSON); err != nil {
		return err
	}
	client, err := newClient(kubeconfig)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	ctx, p.cancel = context.WithCancelCause(ctx)
	dataDir := filepath.Join(kubeletDir, "plugins", driver)
	registry := filepath.Join(kubeletDir, "plugins_registry")
	for _, dir := range []string{dataDir, registry, cdiDir} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return err
		}
	}
	helper, err := kubeletplugin.Start(ctx, p,
		kubeletplugin.KubeClient(client), kubeletplugin.DriverName(driver), kubeletplugin.NodeName(node),
		kubeletplugin.RegistrarDirectoryPath(registry), kubeletplugin.PluginDataDirectoryPath(dataDir),
		kubeletplugin.HealthService(false), kubeletplugin.CDIDirectory(cdiDir),
		kubeletplugin.EnableDeviceMetadata(true, []schema.GroupVersion{metadatav1beta1.SchemeGroupVersion}))
	if err != nil {
		return err
	}
	defer helper.Stop()
	slice := resourceslice.Slice{Devices: []resourceapi.Device{{Name: p.device.Name, Attributes: p.device.Attributes}}}
	resources := resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{node: {Slices: []resourceslice.Slice{slice}}}}
	if err := helper.PublishResources(ctx, resources); err != nil {
		return err
	}
	klog.InfoS("serving", "driver", driver, "node", node, "device", p.device.Name)
	go logRegistration(ctx, helper)
	<-ctx.Done()
	if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
		return cause
	}
	return nil
}

func (p *plugin) load(path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(data, &p.device); err != nil || p.device.Name == "" {
		return fmt.Errorf("device file %s: a name and edits are needed (%v)", path, err)
	}
	p.metadata = make(map[string]resourceapi.DeviceAttribute, len(p.device.Attributes))
	for k, v := range p.device.Attributes {
		p.metadata[string(k)] = v
	}
	return nil
}

func newClient(kubeconfig string) (kubernetes.Interface, error) {
	config, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	config.UserAgent = "sysdra-floor-draplugin" // the bench counts its requests in the audit log
	return kubernetes.NewForConfig(config)
}

// logRegistration logs the kubelet's answer to the registration once: tests wait for the line.
func logRegistration(ctx context.Context, helper *kubeletplugin.Helper) {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if status := helper.RegistrationStatus(); status != nil {
			klog.InfoS("registered with the kubelet", "registered", status.PluginRegistered, "error", status.Error)
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// PrepareResourceClaims gets claims the helper already read from the API server and checked
// (allocated, same UID): one CDI spec per claim for the results of this driver.
func (p *plugin) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		start := time.Now()
		devices, err := p.prepare(claim)
		out[claim.UID] = kubeletplugin.PrepareResult{Devices: devices, Err: err}
		klog.FromContext(ctx).Info("prepare", "claim", klog.KObj(claim), "uid", claim.UID, "err", err, "duration", time.Since(start))
	}
	return out, nil
}

func (p *plugin) prepare(claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	var devices []kubeletplugin.Device
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != p.driver {
			continue
		}
		if r.Pool != p.node || r.Device != p.device.Name {
			return nil, fmt.Errorf("device %s/%s is not on this node", r.Pool, r.Device)
		}
		devices = append(devices, kubeletplugin.Device{
			Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device,
			CDIDeviceIDs: []string{fmt.Sprintf("k8s.%s/claim=%s-%s", p.driver, claim.UID, r.Device)},
			Metadata:     &kubeletplugin.DeviceMetadata{Attributes: p.metadata},
		})
	}
	if len(devices) == 0 {
		return nil, nil
	}
	if len(devices) > 1 { // one device to offer: a second result for it would be the same device twice
		return nil, fmt.Errorf("%d results for the one device %s", len(devices), p.device.Name)
	}
	spec, err := json.Marshal(p.spec(claim.UID))
	if err != nil {
		return nil, err
	}
	return devices, writeAtomically(p.specPath(claim.UID), spec)
}

// spec is the claim's CDI spec: sysdra's layout (docs/kubelet-plugin.md), for one device.
func (p *plugin) spec(uid types.UID) map[string]any {
	claimEdits := map[string]any{}
	for k, v := range p.device.ClaimEdits {
		claimEdits[k] = v
	}
	env, _ := claimEdits["env"].([]any)
	claimEdits["env"] = append([]any{"SYSDRA_CLAIM_UID=" + string(uid)}, env...)
	version := "0.3.0"
	if strings.IndexAny(string(uid)[:1], "0123456789") == 0 { // a device name starting with a digit needs 0.5.0
		version = "0.5.0"
	}
	return map[string]any{
		"cdiVersion": version, "kind": "k8s." + p.driver + "/claim", "containerEdits": claimEdits,
		"devices": []any{map[string]any{"name": string(uid) + "-" + p.device.Name, "containerEdits": p.device.DeviceEdits}},
	}
}

func (p *plugin) specPath(uid types.UID) string {
	return filepath.Join(p.cdiDir, fmt.Sprintf("k8s.%s-claim_%s.json", p.driver, uid))
}

// UnprepareResourceClaims removes the claims' specs; a claim without one is already unprepared.
func (p *plugin) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, claim := range claims {
		err := os.Remove(p.specPath(claim.UID))
		if errors.Is(err, os.ErrNotExist) {
			err = nil
		} else if err == nil {
			err = syncDir(p.cdiDir)
		}
		out[claim.UID] = err
		klog.FromContext(ctx).Info("unprepare", "claim", claim.NamespacedName, "uid", claim.UID, "err", err)
	}
	return out, nil
}

func (p *plugin) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
	if !errors.Is(err, kubeletplugin.ErrRecoverable) {
		p.cancel(fmt.Errorf("%s: %w", msg, err))
	}
}

func (p *plugin) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported // HealthService(false): never called
}

// writeAtomically: a reader sees the old file or the whole new one, and after a crash the new one
// or none (the runtime may read the spec any time after prepare returns).
func writeAtomically(path string, data []byte) error {
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // a no-op after the rename
	_, err = tmp.Write(data)
	if err == nil {
		err = tmp.Chmod(0o644)
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err == nil {
		err = syncDir(dir)
	}
	return err
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = f.Sync()
	return errors.Join(err, f.Close())
}
