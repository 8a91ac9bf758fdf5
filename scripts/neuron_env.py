"""The environment of a vllm-neuron engine, for every target that starts one (`kvferry up`,
`kvferry launch`): one source, checked variable by variable against AWS's public sample.
"""

from __future__ import annotations

import shlex

# vllm-neuron derives each engine's collective bootstrap address as MASTER_ADDR (default
# localhost) : 61234 + its first NEURON_VISIBLE_DEVICES core, and prefers that over an
# inherited NEURON_RT_ROOT_COMM_ID (vllm-project/vllm-neuron
# vllm_neuron/vllm/worker/neuron_worker.py: _CCOM_BASE_PORT, _ccom_addr_from_visible_devices).
NEURON_CCOM_BASE_PORT = 61234

# AWS's public sample for trn2 disaggregated serving: the environment of its prefill and
# decode Deployments (aws-neuron/aws-neuron-eks-samples disagg_serve_vllm/
# prefill-deploy.yaml, decode-deploy.yaml; the decode side differs only in its side-channel
# port). Values kvferry adopts are copied from here.
AWS_SAMPLE_ENV: dict[str, str] = {
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "0.0.0.0",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "5559",
    "CUDA_VISIBLE_DEVICES": "",
    "PYTHONUNBUFFERED": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    "VLLM_NEURON_LOG_LEVEL": "INFO",
    "VLLM_RPC_TIMEOUT": "100000",
    "HF_HOME": "/cache/hf-cache",
    "VLLM_CACHE_ROOT": "/cache/vllm-cache",
    "MODEL_ID": "openai/gpt-oss-20b",
    "HF_TOKEN": "<secret>",
    "HUGGING_FACE_HUB_TOKEN": "<secret>",
    "NIXL_PLUGIN_DIR": "$SP/nixl_cu13.libs/nixl",
    "LD_LIBRARY_PATH": "/opt/nixlstub:<nixl_cu13 libs>:/opt/amazon/efa/lib:$LD_LIBRARY_PATH",
    "NEURON_RT_MAP_HBM": "1",
}

# Every variable of a trn2 engine plan or of AWS's sample, with what kvferry does about it.
NEURON_ENV_VS_AWS_SAMPLE: dict[str, str] = {
    # adopted from the sample
    "NEURON_RT_MAP_HBM": "adopted: HBM mapped into host space, needed by the mapped-HBM "
                         "registration mode (vllm-neuron's worker sets it too)",
    "CUDA_VISIBLE_DEVICES": "adopted: no CUDA device for NIXL's CUDA-linked plugin to find "
                            "through the libcuda stub",
    "PYTHONUNBUFFERED": "adopted: engine logs reach the script's log file as they happen",
    "VLLM_RPC_TIMEOUT": "adopted: a first Neuron compile outlasts vLLM's default RPC timeout",
    "LD_LIBRARY_PATH": "adopted in the script prelude (neuron_prelude): EFA's libfabric "
                       "first, the libcuda stub where libcuda.so.1 is missing",
    # kept by kvferry, not in the sample
    "NEURON_VISIBLE_DEVICES": "kept: vllm-neuron's multiprocess worker refuses "
                              "NEURON_RT_VISIBLE_CORES and reads this (the sample gets its "
                              "cores from a DRA claim instead)",
    "NEURON_RT_ROOT_COMM_ID": "kept: distinct per co-located engine, the value vllm-neuron "
                              "derives itself (61234 + first core), pinned for versions "
                              "that honour an inherited value",
    "NEURON_LOGICAL_NC_CONFIG": "kept: core numbering of the plan (LNC=2: 64 per trn2); the "
                                "sample sets logicalNeuronCore: 2 in its DRA claim",
    "FI_PROVIDER": "kept: efa only, no silent fallback to the tcp provider",
    # vllm-neuron docs/tutorials/tutorial-epd-1e-1pd-xeypd.md (its NIXL/LIBFABRIC HBM READs
    # between engines): "Export these in every VE and PD terminal ... required, not tuning
    # knobs"; without them LIBFABRIC may pick shared memory and a device READ never completes.
    "FI_EFA_USE_DEVICE_RDMA": "kept: device RDMA, required by vllm-neuron's LIBFABRIC/EFA "
                              "tutorial (not in the sample)",
    "FI_EFA_ENABLE_SHM_TRANSFER": "kept: 0 on every Neuron engine, required by vllm-neuron's "
                                  "LIBFABRIC/EFA tutorial; harmless across hosts, needed "
                                  "when P and D share one (the sample can co-locate them)",
    "FI_EFA_USE_HUGE_PAGE": "kept: 0 on every EFA engine (instances.EFA_ENV): huge pages "
                            "are optional for EFA's bounce buffers, and a pod without a "
                            "hugepages request may not touch one (not in the sample)",
    "KVFERRY_NEURON_STAGING": "kept: kvferry's registration mode, only when asked for",
    "KVFERRY_DETOKENIZE_WINDOW": "kept: the API server's detokenizer primed with the "
                                 "prompt's last 32 tokens (every engine kvferry launches; "
                                 "connectors/detokenizer_window.py)",
    # in the sample, not adopted
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "not adopted: upstream NixlConnector's side channel; "
                                   "kvferry's is side_channel_host in its extra config",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "not adopted: upstream NixlConnector's port; kvferry's is "
                                   "side_channel_port in its extra config, one per TP rank",
    "VLLM_LOGGING_LEVEL": "not adopted: INFO, the sample's value, is vLLM's default",
    "VLLM_NEURON_LOG_LEVEL": "not adopted: INFO, the sample's value, is vllm-neuron's default",
    "HF_HOME": "not adopted: the sample's container volume path; the host's own setting wins",
    "VLLM_CACHE_ROOT": "not adopted: the sample's container volume path; where a host keeps "
                       "its compile cache is the host's setting",
    "MODEL_ID": "not adopted: kvferry passes the model on the command line",
    "HF_TOKEN": "not adopted: a secret from the user's environment, never in a script",
    "HUGGING_FACE_HUB_TOKEN": "not adopted: a secret from the user's environment, never in "
                              "a script",
    "NIXL_PLUGIN_DIR": "not adopted: points into the DLC's nixl_cu13 install; the nixl wheel "
                       "finds its own plugins",
}

# AWS's libcuda.so.1 stub: the three CUDA driver symbols NIXL's LIBFABRIC plugin (nixl_cu13)
# links against but never calls on the EFA path (disagg_serve_vllm/prefill-deploy.yaml).
LIBCUDA_STUB_C = (
    "int cuCtxSetCurrent(void *ctx){return 0;}",
    "int cuDeviceGetPCIBusId(char *s,int len,int dev){if(s&&len)s[0]=0;return 0;}",
    "int cuPointerGetAttributes(unsigned int n,void *a,unsigned long long p){return 0;}",
)
EFA_LIB_DIR = "/opt/amazon/efa/lib"


def visible_devices(devs: tuple[int, ...]) -> str:
    """NEURON_VISIBLE_DEVICES form: "8-15" for a contiguous range, else a list (vllm-neuron
    parses "a-b" or "a,b,c", not a mix: vllm_neuron/vllm/platform.py
    device_id_to_physical_device_id)."""
    if list(devs) == list(range(devs[0], devs[-1] + 1)):
        return str(devs[0]) if len(devs) == 1 else f"{devs[0]}-{devs[-1]}"
    return ",".join(map(str, devs))


def neuron_engine_env(devs: tuple[int, ...], staging: str | None = None) -> dict[str, str]:
    """A Neuron engine's variables on NeuronCores ``devs``; each is accounted for in
    NEURON_ENV_VS_AWS_SAMPLE (adopted from AWS's sample, or kept with the reason). The
    core numbering (NEURON_LOGICAL_NC_CONFIG) is the instance type's: instances.py."""
    env = {
        "FI_EFA_ENABLE_SHM_TRANSFER": "0",
        "NEURON_VISIBLE_DEVICES": visible_devices(devs),
        "NEURON_RT_ROOT_COMM_ID": f"localhost:{NEURON_CCOM_BASE_PORT + devs[0]}",
    }
    for var in ("NEURON_RT_MAP_HBM", "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED",
                "VLLM_RPC_TIMEOUT"):
        env[var] = AWS_SAMPLE_ENV[var]
    if staging:
        env["KVFERRY_NEURON_STAGING"] = staging
    return env


def neuron_prelude(stub_dir: str = "$HOME/.cache/kvferry/libcuda-stub") -> list[str]:
    """Shell lines a Neuron host runs before its engines: AWS's sample puts EFA's libfabric
    on the loader path and gives NIXL's CUDA-linked LIBFABRIC plugin a no-op libcuda.so.1
    (disagg_serve_vllm/prefill-deploy.yaml); here the stub is built only where
    libcuda.so.1 is missing."""
    src = " ".join(shlex.quote(line) for line in LIBCUDA_STUB_C)
    return [
        "# NIXL's LIBFABRIC plugin links libcuda.so.1, which Trainium hosts lack: a no-op stub",
        "if ! ldconfig -p | grep 'libcuda.so.1 ' > /dev/null; then",
        f'  mkdir -p "{stub_dir}"',
        f"  printf '%s\\n' {src} > \"{stub_dir}/stub.c\"",
        f'  cc -shared -fPIC -o "{stub_dir}/libcuda.so.1" "{stub_dir}/stub.c"',
        f'  export LD_LIBRARY_PATH="{stub_dir}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"',
        "fi",
        "# EFA's libfabric (>= 1.21, FI_HMEM_NEURON) before any distro libfabric",
        f'export LD_LIBRARY_PATH="{EFA_LIB_DIR}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"',
    ]
