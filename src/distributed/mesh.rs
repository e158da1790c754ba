//! The process mesh of a run: the world of `dp × cp` ranks and the groups split from it,
//! in Megatron-LM's layout (`megatron/core/parallel_state.py`, `initialize_model_parallel`):
//!
//! ```text
//! world            dp·cp ranks: the data-parallel world (FSDP shards over it, gradients summed over it)
//! context  (cp)    ranks  k·cp .. (k+1)·cp      one packed micro-batch split into cp shards
//! expert   (ep)    ranks  k·ep .. (k+1)·ep      the routed experts split; tokens exchanged
//! expert-data      ranks  r ≡ q (mod ep)         the ranks holding the same experts
//! ```
//!
//! [`Mesh::new`] splits an explicit world (any [`ProcessGroup`]); [`Mesh::from_env`] joins
//! the world the launcher started (`mpirun`, Slurm's `srun`, MPICH's Hydra), or is one process
//! when none did. A refusal every rank reaches alike (sizes that do not multiply to the
//! launched world, a rank running another recipe: [`Mesh::agree`]) is written once, by rank 0,
//! and every rank returns [`DistError::Mesh`] with `reported` set — the launcher kills the job at
//! the first rank that exits, which would otherwise race rank 0's message.

use std::sync::Arc;

use crate::comm::group::Group;
use crate::comm::local::LocalGroup;
use crate::comm::typed::all_gather;
use crate::comm::DistError;

/// How many ranks each parallelism takes: `dp × cp` processes in all, `ep` dividing them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshSizes {
    /// Data-parallel replicas (each its own share of every global batch).
    pub dp: usize,
    /// Context-parallel shards of each packed micro-batch (consecutive ranks).
    pub cp: usize,
    /// Expert-parallel ranks the routed experts are split over (consecutive ranks; 1: off).
    pub ep: usize,
}

impl Default for MeshSizes {
    fn default() -> Self {
        Self { dp: 1, cp: 1, ep: 1 }
    }
}

/// Environment variables [`MeshSizes::from_env`] reads.
pub const SIZE_VARS: [&str; 3] = ["GLM5_DP_SIZE", "GLM5_CP_SIZE", "GLM5_EP_SIZE"];

impl MeshSizes {
    /// Processes the mesh holds: `dp × cp`.
    pub fn world(&self) -> usize {
        self.dp * self.cp
    }

    /// Sizes from `GLM5_DP_SIZE`, `GLM5_CP_SIZE` and `GLM5_EP_SIZE` (each defaulting to 1;
    /// `dp` to the launched processes divided by `cp`). An error naming a variable that is not
    /// a positive integer.
    pub fn from_env() -> Result<Self, DistError> {
        let read = |name: &str| -> Result<Option<usize>, DistError> {
            match std::env::var(name) {
                Err(_) => Ok(None),
                Ok(v) => match v.trim().parse::<usize>() {
                    Ok(n) if n > 0 => Ok(Some(n)),
                    _ => Err(mesh_error(format!("{name}={v:?} is not a positive integer"))),
                },
            }
        };
        let cp = read(SIZE_VARS[1])?.unwrap_or(1);
        let ep = read(SIZE_VARS[2])?.unwrap_or(1);
        let dp = read(SIZE_VARS[0])?.unwrap_or_else(|| (launched_processes() / cp).max(1));
        Ok(Self { dp, cp, ep })
    }

    /// Whether the sizes fit a world of `world` processes: an error naming the sizes (as
    /// `names` spell them: [`RECIPE_KEYS`], [`SIZE_VARS`]) and the launch that would fit them.
    pub fn check(&self, world: usize, names: [&str; 3]) -> Result<(), DistError> {
        let Self { dp, cp, ep } = *self;
        let [n_dp, n_cp, n_ep] = names;
        if dp == 0 || cp == 0 || ep == 0 {
            return Err(mesh_error(format!("every mesh size must be at least 1 ({n_dp} {dp}, {n_cp} {cp}, {n_ep} {ep})")));
        }
        if self.world() != world {
            return Err(mesh_error(match cp {
                1 => format!("{n_dp} is {dp} but {world} processes were started: launch with `mpirun -np {dp}`, or set {n_dp}={world}"),
                _ => format!("{n_dp} × {n_cp} is {dp} × {cp} = {} but {world} processes were started: launch with `mpirun -np {}`", dp * cp, dp * cp),
            }));
        }
        if !world.is_multiple_of(ep) {
            return Err(mesh_error(format!("{n_ep} {ep} does not divide the {world} data-parallel ranks ({n_dp} × {n_cp})")));
        }
        Ok(())
    }
}

/// The recipe's names of the sizes (`distributed:` section).
pub const RECIPE_KEYS: [&str; 3] = ["distributed.dp_size", "distributed.cp_size", "distributed.ep_size"];

fn mesh_error(message: String) -> DistError {
    DistError::Mesh { message, reported: false }
}

/// The process groups of expert parallelism over a data-parallel world of `W` ranks with
/// `ep_size = P` (Megatron's layout): the expert-parallel groups are the contiguous blocks
/// `k·P .. (k+1)·P` (rank `r` holds the experts of expert-parallel rank `r mod P`), and the
/// expert-data-parallel groups join the ranks holding the same experts (`r mod P` equal), over
/// which the experts' gradients are summed.
#[derive(Debug, Clone)]
pub struct ExpertMesh {
    /// This rank's expert-parallel group (size `P`).
    pub ep: Group,
    /// This rank's expert-data-parallel group (size `W / P`).
    pub edp: Group,
}

impl ExpertMesh {
    /// Split `world` (a collective call: every rank of it makes it). An error naming both
    /// sizes when `ep_size` does not divide the world.
    pub fn new(world: &Group, ep_size: usize) -> Result<Self, DistError> {
        let (r, w) = (world.rank(), world.size());
        if ep_size == 0 || w % ep_size != 0 {
            return Err(DistError::Counts {
                op: "expert parallelism",
                message: format!("ep_size {ep_size} does not divide the {w} data-parallel ranks"),
            });
        }
        let ep: Group = Arc::from(world.split(r / ep_size, r)?);
        let edp: Group = Arc::from(world.split(r % ep_size, r)?);
        Ok(Self { ep, edp })
    }
}

/// Which of a [`Mesh`]'s groups a parallel seam of the model runs over
/// ([`super::device::seam_group`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MeshRole {
    /// The data-parallel world (FSDP's dense shards).
    World,
    /// The context-parallel group (a packed row's shards).
    Context,
    /// The expert-parallel group (the routed experts' exchanges).
    Expert,
    /// The expert-data-parallel group (the experts' FSDP shards).
    ExpertData,
}

impl MeshRole {
    /// The role as messages name it.
    pub fn name(self) -> &'static str {
        match self {
            Self::World => "data-parallel world",
            Self::Context => "context-parallel group",
            Self::Expert => "expert-parallel group",
            Self::ExpertData => "expert-data-parallel group",
        }
    }
}

/// A world of processes and the groups of its parallelisms (module docs).
#[derive(Debug, Clone)]
pub struct Mesh {
    world: Group,
    sizes: MeshSizes,
    context: Option<Group>,
    expert: Option<ExpertMesh>,
}

impl Mesh {
    /// One process: every size 1, the size-1 group.
    pub fn single() -> Self {
        Self { world: Arc::new(LocalGroup), sizes: MeshSizes::default(), context: None, expert: None }
    }

    /// The mesh of `sizes` over `world` (a collective call: every rank of `world` makes it,
    /// with the same sizes). An error naming the sizes when they do not fit the world.
    pub fn new(world: Group, sizes: MeshSizes) -> Result<Self, DistError> {
        sizes.check(world.size(), RECIPE_KEYS)?;
        let r = world.rank();
        let context = match sizes.cp {
            1 => None,
            cp => Some(Group::from(world.split(r / cp, r)?)),
        };
        let expert = match sizes.ep {
            1 => None,
            ep => Some(ExpertMesh::new(&world, ep)?),
        };
        Ok(Self { world, sizes, context, expert })
    }

    /// The mesh of the processes the launcher started: `sizes` (or [`MeshSizes::from_env`]),
    /// over MPI's world when several processes run or are asked for, else one process. With
    /// `GLM5_CHECK_COLLECTIVES=1` every collective is checked to be the same on every rank
    /// ([`super::CheckedGroup`]). Refusals every rank reaches alike are reported once (module
    /// docs); without the `mpi` feature, several processes are an error saying how to build.
    /// Errors name the sizes as the recipe spells them ([`RECIPE_KEYS`]) when given, as the
    /// environment does ([`SIZE_VARS`]) when read from it.
    pub fn from_env(sizes: Option<MeshSizes>) -> Result<Self, DistError> {
        let (sizes, names) = match sizes {
            Some(s) => (s, RECIPE_KEYS),
            None => (MeshSizes::from_env()?, SIZE_VARS),
        };
        let launched = launched_processes();
        if sizes.world() == 1 && launched == 1 {
            sizes.check(1, names)?;
            return Ok(Self::single());
        }
        let world = world_group(sizes.world(), launched)?;
        // the ranks agree on the sizes first: a rank that went on to split groups while another
        // stopped would leave both waiting in different collectives
        let all = all_gather(&*world, &[sizes.dp as u64, sizes.cp as u64, sizes.ep as u64])?;
        if let Some(r) = all.chunks(3).position(|c| c != &all[..3]) {
            let [n_dp, n_cp, n_ep] = names;
            let c = &all[3 * r..3 * r + 3];
            let message = format!(
                "rank {r} asks for {n_dp} {}, {n_cp} {}, {n_ep} {} but rank 0 for {}, {}, {}: give every rank the same sizes",
                c[0], c[1], c[2], all[0], all[1], all[2]
            );
            return Err(report_alike(&world, mesh_error(message)));
        }
        if let Err(e) = sizes.check(world.size(), names) {
            return Err(report_alike(&world, e));
        }
        Self::new(world, sizes)
    }

    /// The data-parallel world: every rank of the mesh.
    pub fn world(&self) -> &Group {
        &self.world
    }

    /// The data-parallel world when it holds several ranks (`None`: one process).
    pub fn data_parallel(&self) -> Option<&Group> {
        (self.world.size() > 1).then_some(&self.world)
    }

    /// This rank in the world.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// The world's size.
    pub fn size(&self) -> usize {
        self.world.size()
    }

    /// The sizes the mesh was built with.
    pub fn sizes(&self) -> MeshSizes {
        self.sizes
    }

    /// This rank's context-parallel group (`None` when `cp` is 1).
    pub fn context(&self) -> Option<&Group> {
        self.context.as_ref()
    }

    /// This rank's expert-parallel and expert-data-parallel groups (`None` when `ep` is 1).
    pub fn expert(&self) -> Option<&ExpertMesh> {
        self.expert.as_ref()
    }

    /// The group of `role` (`None` where the mesh has none: `cp` or `ep` of 1).
    pub fn group(&self, role: MeshRole) -> Option<&Group> {
        match role {
            MeshRole::World => Some(&self.world),
            MeshRole::Context => self.context.as_ref(),
            MeshRole::Expert => self.expert.as_ref().map(|e| &e.ep),
            MeshRole::ExpertData => self.expert.as_ref().map(|e| &e.edp),
        }
    }

    /// This rank's data-parallel replica (`rank / cp`) and the replicas (`dp`): which share
    /// of every global batch it reads (the ranks of a context-parallel group read the same).
    pub fn data_shard(&self) -> (usize, usize) {
        (self.rank() / self.sizes.cp, self.sizes.dp)
    }

    /// Every rank holds the same `value` (a hash of `what`: the recipe, the data): an error
    /// naming the first rank that differs from rank 0, reported once (module docs). `hint`
    /// says what to do (`give every rank the same recipe`). A collective call.
    pub fn agree(&self, what: &str, value: u64, hint: &str) -> Result<(), DistError> {
        if self.size() == 1 {
            return Ok(());
        }
        let values = all_gather(&*self.world, &[value])?;
        match values.iter().position(|&v| v != values[0]) {
            None => Ok(()),
            Some(r) => Err(report_alike(
                &self.world,
                mesh_error(format!("rank {r} has a different {what} than rank 0 (hash {:016x} vs {:016x}): {hint}", values[r], values[0])),
            )),
        }
    }
}

/// `error`, which every rank of `world` reached alike, written once by rank 0; the ranks then
/// wait for each other so none exits (and has the launcher kill the job) before rank 0 wrote it.
fn report_alike(world: &Group, error: DistError) -> DistError {
    let DistError::Mesh { message, .. } = error else { return error };
    if world.rank() == 0 {
        eprintln!("Error: {message}");
    }
    match world.barrier() {
        Ok(()) => DistError::Mesh { message, reported: true },
        Err(e) => e,
    }
}

/// The launched world: MPI's, checked with `GLM5_CHECK_COLLECTIVES=1`.
#[cfg(feature = "mpi")]
fn world_group(_wanted: usize, _launched: usize) -> Result<Group, DistError> {
    let world = super::MpiGroup::world()?;
    if std::env::var("GLM5_CHECK_COLLECTIVES").is_ok_and(|v| v == "1") {
        return Ok(Arc::new(super::CheckedGroup::new(Box::new(world))));
    }
    Ok(Arc::new(world))
}

#[cfg(not(feature = "mpi"))]
fn world_group(wanted: usize, launched: usize) -> Result<Group, DistError> {
    Err(mesh_error(format!(
        "a mesh of {wanted} ranks with {launched} processes launched needs the MPI engine: build with `--features mpi` and launch with `mpirun -np {wanted}`"
    )))
}

/// Processes the launcher started (OpenMPI `OMPI_COMM_WORLD_SIZE`, MPICH/Hydra `PMI_SIZE`,
/// PMIx `PMIX_SIZE`, a Slurm step's `SLURM_STEP_NUM_TASKS`); 1 when none is set.
pub fn launched_processes() -> usize {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS"]
        .iter()
        .find_map(|k| std::env::var(k).ok().and_then(|v| v.parse().ok()))
        .unwrap_or(1)
}

/// This process's rank as the launcher numbers it, before MPI is started; 0 for one process.
pub fn launcher_rank() -> usize {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"]
        .iter()
        .find_map(|k| std::env::var(k).ok().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}
