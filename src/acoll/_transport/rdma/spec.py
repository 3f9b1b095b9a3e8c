"""Numbers from the verbs interface (``infiniband/verbs.h``), for the sans-IO modules.

These values are part of libibverbs' ABI and never change; the adapter passes pyverbs its
own enum objects, and tests check that pyverbs (when installed) and the verbs test double
agree with the values here. Only what the transport reasons about is listed.
"""

from __future__ import annotations

__all__ = [
    "ACCESS_LOCAL_WRITE", "ACCESS_REMOTE_READ", "ACCESS_REMOTE_WRITE",
    "EVENT_NAMES", "GID_TYPE_IB", "GID_TYPE_ROCE_V1", "GID_TYPE_ROCE_V2",
    "LINK_LAYER_ETHERNET", "LINK_LAYER_INFINIBAND", "LINK_LAYER_UNSPECIFIED",
    "MTU_BYTES", "PORT_ACTIVE", "QPS_ERR", "QPS_INIT", "QPS_RESET", "QPS_RTR", "QPS_RTS",
    "QP_STATE_NAMES", "WC_RDMA_READ", "WC_RECV", "WC_RECV_RDMA_WITH_IMM", "WC_RDMA_WRITE",
    "WC_SEND",
    "WC_STATUS_NAMES", "WC_SUCCESS", "WC_WR_FLUSH_ERR", "mtu_bytes", "mtu_enum",
]

# enum ibv_qp_state
QPS_RESET, QPS_INIT, QPS_RTR, QPS_RTS, QPS_SQD, QPS_SQE, QPS_ERR = range(7)
QP_STATE_NAMES = {QPS_RESET: "RESET", QPS_INIT: "INIT", QPS_RTR: "RTR", QPS_RTS: "RTS",
                  QPS_SQD: "SQD", QPS_SQE: "SQE", QPS_ERR: "ERR"}

# enum ibv_access_flags
ACCESS_LOCAL_WRITE = 1
ACCESS_REMOTE_WRITE = 1 << 1
ACCESS_REMOTE_READ = 1 << 2

# enum ibv_mtu
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}

# enum ibv_port_state
PORT_ACTIVE = 4

# link layer
LINK_LAYER_UNSPECIFIED, LINK_LAYER_INFINIBAND, LINK_LAYER_ETHERNET = 0, 1, 2

# enum ibv_gid_type (ibv_query_gid_ex)
GID_TYPE_IB, GID_TYPE_ROCE_V1, GID_TYPE_ROCE_V2 = 0, 1, 2

# enum ibv_wc_opcode
WC_SEND, WC_RDMA_WRITE, WC_RDMA_READ = 0, 1, 2
WC_RECV = 1 << 7
WC_RECV_RDMA_WITH_IMM = WC_RECV + 1

# enum ibv_wc_status
WC_STATUS_NAMES = {
    0: "SUCCESS", 1: "LOC_LEN_ERR", 2: "LOC_QP_OP_ERR", 3: "LOC_EEC_OP_ERR",
    4: "LOC_PROT_ERR", 5: "WR_FLUSH_ERR", 6: "MW_BIND_ERR", 7: "BAD_RESP_ERR",
    8: "LOC_ACCESS_ERR", 9: "REM_INV_REQ_ERR", 10: "REM_ACCESS_ERR", 11: "REM_OP_ERR",
    12: "RETRY_EXC_ERR", 13: "RNR_RETRY_EXC_ERR", 14: "LOC_RDD_VIOL_ERR",
    15: "REM_INV_RD_REQ_ERR", 16: "REM_ABORT_ERR", 17: "INV_EECN_ERR",
    18: "INV_EEC_STATE_ERR", 19: "FATAL_ERR", 20: "RESP_TIMEOUT_ERR", 21: "GENERAL_ERR",
}
WC_SUCCESS = 0
WC_WR_FLUSH_ERR = 5

# enum ibv_event_type
EVENT_NAMES = {
    0: "CQ_ERR", 1: "QP_FATAL", 2: "QP_REQ_ERR", 3: "QP_ACCESS_ERR", 4: "COMM_EST",
    5: "SQ_DRAINED", 6: "PATH_MIG", 7: "PATH_MIG_ERR", 8: "DEVICE_FATAL", 9: "PORT_ACTIVE",
    10: "PORT_ERR", 11: "LID_CHANGE", 12: "PKEY_CHANGE", 13: "SM_CHANGE", 14: "SRQ_ERR",
    15: "SRQ_LIMIT_REACHED", 16: "QP_LAST_WQE_REACHED", 17: "CLIENT_REREGISTER",
    18: "GID_CHANGE", 19: "WQ_FATAL",
}


def mtu_bytes(mtu: int) -> int:
    """Bytes of an ``ibv_mtu`` value (``5`` -> 4096).

    Raises:
        ValueError: not an ``ibv_mtu`` value.
    """
    try:
        return MTU_BYTES[mtu]
    except KeyError:
        raise ValueError(f"{mtu!r} is not an ibv_mtu value (1..5)") from None


def mtu_enum(nbytes: int) -> int:
    """The ``ibv_mtu`` value of ``nbytes`` (256, 512, 1024, 2048 or 4096).

    Raises:
        ValueError: not one of those sizes.
    """
    for enum, size in MTU_BYTES.items():
        if size == nbytes:
            return enum
    raise ValueError(f"{nbytes} is not an RDMA path MTU (256, 512, 1024, 2048, 4096)")
