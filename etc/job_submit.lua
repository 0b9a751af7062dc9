--[[
slurm-idle job_submit plugin: every job on the preemptible partition is requeueable.

The `idle` partition runs on GPUs lent by the inference fleet; they are taken back at any time
(PreemptMode=REQUEUE). A job there must come back to the queue when that happens, so:
  * a job submitted to `idle` without --requeue is made requeueable (job_desc.requeue = 1);
  * a job that explicitly asks for --no-requeue there is rejected with a message saying why;
  * `scontrol update job=N requeue=0` on such a job is refused the same way;
  * `scontrol update job=N partition=idle` (moving a job onto it) also sets requeue=1, so a job
    submitted elsewhere with --no-requeue cannot reach the lent GPUs that way. (Slurm's lua API
    does not expose the job record's requeue flag in slurm_job_modify, so the update itself
    carries the flag: the moved job ends up requeueable whatever it had.)
  * an interactive job (srun or salloc outside an allocation: Slurm hands the plugin no batch
    script, job_desc.script is nil) is rejected there: Slurm cannot requeue it ("Only batch jobs
    are accepted"), so a reclaim could only signal and cancel it, and until then it would hold
    a GPU node the service needs. Set ALLOW_INTERACTIVE = true to accept them anyway: the agent
    then signals them at reclaim, waits slurm.requeue_grace_s and cancels them.
    (srun *inside* a batch job starts a step, not a job: this plugin never sees it.)
Jobs on other partitions are left untouched.

Install: copy beside slurm.conf as job_submit.lua and set `JobSubmitPlugins=lua`
(slurmctld reads it again when the file changes). Keep LEND_PARTITION equal to
`slurm.lend_partition` in slurm-idle.yaml.
--]]

local LEND_PARTITION = "idle"

-- Accept srun/salloc jobs on the lend partition (they are cancelled, not requeued, at reclaim).
local ALLOW_INTERACTIVE = false

-- Slurm leaves job_desc.requeue at NO_VAL16 (65534) when the user gave neither flag.
local NO_VAL16 = 65534

local REJECT_MESSAGE = "slurm-idle: jobs on partition '" .. LEND_PARTITION .. "' run on borrowed GPUs and are " ..
	"requeued when their node is reclaimed, so --no-requeue is not allowed there. " ..
	"Drop --no-requeue (and resume from a checkpoint on restart), or submit to another partition."

local INTERACTIVE_MESSAGE = "slurm-idle: partition '" .. LEND_PARTITION .. "' takes batch jobs only: " ..
	"its GPUs are reclaimed at any time, and Slurm can requeue a batch job but not an " ..
	"interactive srun/salloc job. Submit a script with sbatch (and resume from a checkpoint), " ..
	"or use another partition for interactive work."

-- The partitions a job asks for ("a,b" lists allowed), or the default partition when none.
local function requested_partitions(partition, part_list)
	local names = {}
	if partition ~= nil and partition ~= "" then
		for name in string.gmatch(partition, "[^,]+") do
			table.insert(names, name)
		end
		return names
	end
	for _, part in pairs(part_list or {}) do
		if part.flag_default ~= nil and part.flag_default ~= 0 then
			table.insert(names, part.name)
		end
	end
	return names
end

local function targets_lend_partition(partition, part_list)
	for _, name in ipairs(requested_partitions(partition, part_list)) do
		if name == LEND_PARTITION then
			return true
		end
	end
	return false
end

function slurm_job_submit(job_desc, part_list, submit_uid)
	if not targets_lend_partition(job_desc.partition, part_list) then
		return slurm.SUCCESS
	end
	if job_desc.requeue == 0 then
		slurm.log_info("slurm-idle: rejected --no-requeue job '%s' of uid %u on %s",
			tostring(job_desc.name), submit_uid, LEND_PARTITION)
		slurm.log_user(REJECT_MESSAGE)
		return slurm.ERROR
	end
	if not ALLOW_INTERACTIVE and (job_desc.script == nil or job_desc.script == "") then
		slurm.log_info("slurm-idle: rejected interactive job '%s' of uid %u on %s",
			tostring(job_desc.name), submit_uid, LEND_PARTITION)
		slurm.log_user(INTERACTIVE_MESSAGE)
		return slurm.ERROR
	end
	if job_desc.requeue == nil or job_desc.requeue == NO_VAL16 then
		job_desc.requeue = 1
	end
	return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	local partition = job_desc.partition or (job_rec and job_rec.partition)
	if not targets_lend_partition(partition, part_list) then
		return slurm.SUCCESS
	end
	if job_desc.requeue == 0 then
		slurm.log_user(REJECT_MESSAGE)
		return slurm.ERROR
	end
	-- A move onto the lend partition: job_rec has no requeue field to check, so make the job
	-- requeueable as part of the same update (what slurm_job_submit does for new jobs).
	if job_desc.partition ~= nil and job_desc.partition ~= "" then
		slurm.log_info("slurm-idle: job %s moved to %s: made requeueable",
			tostring(job_rec and job_rec.job_id), LEND_PARTITION)
		job_desc.requeue = 1
	end
	return slurm.SUCCESS
end

slurm.log_info("slurm-idle job_submit.lua loaded (lend partition '%s')", LEND_PARTITION)
return slurm.SUCCESS
